#!/usr/bin/env bash
# Install GPUlayer into a venv of its own and run its peer as a service:
# a launchd agent on macOS, a systemd unit on Linux (a user unit, or a system one with --system).
# Run it with --help for the options, and with --dry-run to see every action first.
set -euo pipefail

PROG=$(basename "$0")
SCRIPT_DIR=$(cd -P "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CHECKOUT=$(cd -P "$SCRIPT_DIR/.." && pwd)
LABEL="dev.gpulayer.peer"
UNIT_NAME="gpulayer-peer.service"
MARKER=".gpulayer-install"  # written into the venvs this script makes; only those are ever removed

usage() {
    cat <<EOF
Usage: $PROG [options]

Installs GPUlayer into a venv, creates the cluster key if there is none, and runs the peer
(python -m gpulayer.peer) as a service: a launchd agent on macOS
(~/Library/LaunchAgents/$LABEL.plist), a systemd user unit on Linux
(~/.config/systemd/user/$UNIT_NAME), or with --system a system unit
(/etc/systemd/system/$UNIT_NAME) running as a user of its own.

Options:
  --prefix DIR            the venv (default: ~/.local/share/gpulayer/venv; with --system: /opt/gpulayer/venv)
  --from PATH|SPEC        what to pip install: a checkout, a wheel, or a requirement such as
                          'gpulayer[torch]' (default: this checkout, $CHECKOUT)
  --python PY             the Python that creates the venv (default: python3; 3.10 or newer)
  --system-site-packages  let the venv see the packages of that Python (e.g. its torch)
  --pip-args "ARGS"       more arguments for pip install, split on spaces (e.g. "--no-deps")
  --peer-args "ARGS"      arguments for the peer, split on spaces (e.g. "--port 7340 --concurrency 2")
  --env NAME=VALUE        a variable in the service's environment, so for the peer, its workers and
                          its tasks; repeatable (e.g. --env PYTORCH_ENABLE_MPS_FALLBACK=1)
  --key-file PATH         the cluster key (default: ~/.config/gpulayer/key; with --system: /etc/gpulayer/key)
  --no-key                do not create the cluster key when it is missing
  --system                Linux: a system unit in /etc/systemd/system, run as --service-user (needs root)
  --service-user NAME     the user of the system unit (default: gpulayer; created when missing)
  --no-service            install the venv (and key) only; no unit or plist
  --no-start              write (or remove) the unit or plist only: do not call systemctl or launchctl
  --unit-dir DIR          write the unit or plist into DIR instead of the standard folder
  --os linux|macos        the target system (default: this one)
  --uninstall             stop and remove the service, its unit or plist, and the venv this script made
  --purge                 with --uninstall: remove the cluster key and the logs too
  --dry-run               print every action, and the unit or plist, without changing anything
  -h, --help              this help
EOF
}

die() { printf '%s: %s\n' "$PROG" "$*" >&2; exit 2; }
say() { printf '%s\n' "$*"; }

PREFIX="" FROM="" PYTHON="python3" SYSTEM_SITE=0 PIP_ARGS="" PEER_ARGS="" KEY_FILE="" NO_KEY=0 SYSTEM=0
SERVICE_USER="gpulayer" NO_SERVICE=0 NO_START=0 UNIT_DIR="" TARGET_OS="" UNINSTALL=0 PURGE=0 DRY_RUN=0
SERVICE_ENV=("PYTHONUNBUFFERED=1")  # NAME=VALUE, in order; --env adds to it

need_value() { [ "$#" -ge 2 ] || die "$1 needs a value"; }

add_env() {  # add_env NAME=VALUE (from --env): checked; it replaces an earlier one of the same name
    local name=${1%%=*} i
    [[ "$1" == *=* ]] || die "--env needs NAME=VALUE, not '$1'"
    [[ "$name" =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || die "--env: '$name' is not a variable name"
    case "$name" in GPULAYER_*) die "--env: $name is a GPUlayer setting, not a variable for tasks: use --peer-args or --key-file" ;; esac
    [[ ! "$1" =~ [[:cntrl:]] ]] || die "--env: the value of $name holds a control character (a line break?)"
    for i in "${!SERVICE_ENV[@]}"; do
        if [ "${SERVICE_ENV[$i]%%=*}" = "$name" ]; then SERVICE_ENV[i]=$1; return; fi
    done
    SERVICE_ENV+=("$1")
}

while [ "$#" -gt 0 ]; do
    case "$1" in
        --prefix) need_value "$@"; PREFIX=$2; shift 2 ;;
        --from) need_value "$@"; FROM=$2; shift 2 ;;
        --python) need_value "$@"; PYTHON=$2; shift 2 ;;
        --system-site-packages) SYSTEM_SITE=1; shift ;;
        --pip-args) need_value "$@"; PIP_ARGS=$2; shift 2 ;;
        --peer-args) need_value "$@"; PEER_ARGS=$2; shift 2 ;;
        --env) need_value "$@"; add_env "$2"; shift 2 ;;
        --key-file) need_value "$@"; KEY_FILE=$2; shift 2 ;;
        --no-key) NO_KEY=1; shift ;;
        --system) SYSTEM=1; shift ;;
        --service-user) need_value "$@"; SERVICE_USER=$2; shift 2 ;;
        --no-service) NO_SERVICE=1; shift ;;
        --no-start) NO_START=1; shift ;;
        --unit-dir) need_value "$@"; UNIT_DIR=$2; shift 2 ;;
        --os) need_value "$@"; TARGET_OS=$2; shift 2 ;;
        --uninstall) UNINSTALL=1; shift ;;
        --purge) PURGE=1; shift ;;
        --dry-run) DRY_RUN=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) die "unknown option '$1' (see --help)" ;;
    esac
done

if [ -z "$TARGET_OS" ]; then
    case "$(uname -s)" in
        Darwin) TARGET_OS=macos ;;
        Linux) TARGET_OS=linux ;;
        *) die "unsupported system $(uname -s); pass --os linux or --os macos" ;;
    esac
fi
case "$TARGET_OS" in linux|macos) ;; *) die "--os must be linux or macos, not '$TARGET_OS'" ;; esac
[ "$SYSTEM" = 0 ] || [ "$TARGET_OS" = linux ] || die "--system is for Linux; on macOS the peer runs as a launchd agent of your user"
[ "$PURGE" = 0 ] || [ "$UNINSTALL" = 1 ] || die "--purge goes with --uninstall"
[[ "$SERVICE_USER" =~ ^[a-z_][a-z0-9_-]*$ ]] || die "bad --service-user '$SERVICE_USER'"

if [ "$SYSTEM" = 1 ]; then
    PREFIX=${PREFIX:-/opt/gpulayer/venv}
    KEY_FILE=${KEY_FILE:-/etc/gpulayer/key}
    SERVICE_HOME="/var/lib/gpulayer"
else
    PREFIX=${PREFIX:-$HOME/.local/share/gpulayer/venv}
    KEY_FILE=${KEY_FILE:-${XDG_CONFIG_HOME:-$HOME/.config}/gpulayer/key}
fi
case "$PREFIX" in /*) ;; *) PREFIX="$PWD/$PREFIX" ;; esac
case "$KEY_FILE" in /*) ;; *) KEY_FILE="$PWD/$KEY_FILE" ;; esac
VENV_PY="$PREFIX/bin/python"

if [ "$TARGET_OS" = macos ]; then
    UNIT_DIR=${UNIT_DIR:-$HOME/Library/LaunchAgents}
    UNIT_FILE="$UNIT_DIR/$LABEL.plist"
    LOG_DIR="$HOME/Library/Logs/gpulayer"
elif [ "$SYSTEM" = 1 ]; then
    UNIT_DIR=${UNIT_DIR:-/etc/systemd/system}
    UNIT_FILE="$UNIT_DIR/$UNIT_NAME"
else
    UNIT_DIR=${UNIT_DIR:-${XDG_CONFIG_HOME:-$HOME/.config}/systemd/user}
    UNIT_FILE="$UNIT_DIR/$UNIT_NAME"
fi
case "$UNIT_DIR" in /*) ;; *) UNIT_DIR="$PWD/$UNIT_DIR"; UNIT_FILE="$PWD/$UNIT_FILE" ;; esac

read -r -a PEER_ARGV <<< "$PEER_ARGS"
read -r -a PIP_ARGV <<< "$PIP_ARGS"

# ---- doing, or only saying what would be done --------------------------------------------------

run() {  # run a command, or print it (shell-quoted) under --dry-run
    if [ "$DRY_RUN" = 1 ]; then
        printf '+'; printf ' %q' "$@"; printf '\n'
    else
        "$@"
    fi
}

try() {  # run a command whose failure is fine (stopping what is not running, say)
    if [ "$DRY_RUN" = 1 ]; then
        printf '+'; printf ' %q' "$@"; printf '  (its failure is ignored)\n'
    else
        "$@" >/dev/null 2>&1 || true
    fi
}

write_file() {  # write_file PATH MODE CONTENT
    local path=$1 mode=$2 content=$3
    if [ "$DRY_RUN" = 1 ]; then
        printf '+ write %s (mode %s):\n' "$path" "$mode"
        printf -- '----- BEGIN %s -----\n%s----- END %s -----\n' "$path" "$content" "$path"
        return
    fi
    mkdir -p "$(dirname "$path")"
    local tmp="$path.tmp.$$"
    printf '%s' "$content" > "$tmp"
    chmod "$mode" "$tmp"
    mv -f "$tmp" "$path"
    say "wrote $path"
}

remove() {  # remove a file or folder if it is there
    if [ -e "$1" ] || [ -L "$1" ] || [ "$DRY_RUN" = 1 ]; then
        run rm -rf -- "$1"
    fi
}

# ---- the service definitions ---------------------------------------------------------------------

xml_escape() {  # sed, not ${s//</&lt;}: bash 5.2 gives "&" in a replacement a meaning of its own
    printf '%s' "$1" | sed -e 's/&/\&amp;/g' -e 's/</\&lt;/g' -e 's/>/\&gt;/g' -e 's/"/\&quot;/g'
}

systemd_escape() {  # for the inside of a double-quoted unit value: backslashes, quotes, % specifiers
    local s=$1
    s=${s//\\/\\\\}; s=${s//\"/\\\"}; s=${s//%/%%}
    printf '%s' "$s"
}

systemd_quote() {  # one ExecStart word: quoted when it holds anything but safe characters
    local s=$1
    if [[ "$s" =~ ^[A-Za-z0-9_./:=,@+-]+$ ]]; then
        printf '%s' "$s"
    else
        s=$(systemd_escape "$s")
        printf '"%s"' "${s//\$/\$\$}"  # ExecStart expands $NAME; Environment= does not
    fi
}

peer_command() {  # the peer's argv, one word a line
    printf '%s\n' "$VENV_PY" -m gpulayer.peer --key-file "$KEY_FILE"
    if [ "${#PEER_ARGV[@]}" -gt 0 ]; then printf '%s\n' "${PEER_ARGV[@]}"; fi
}

systemd_unit() {
    local exec="" word assignment
    while IFS= read -r word; do exec+="${exec:+ }$(systemd_quote "$word")"; done < <(peer_command)
    printf '[Unit]\n'
    printf 'Description=GPUlayer peer (offers this machine'"'"'s GPUs to the cluster)\n'
    if [ "$SYSTEM" = 1 ]; then
        printf 'Wants=network-online.target\nAfter=network-online.target\n'
    fi
    printf '\n[Service]\nType=simple\nExecStart=%s\n' "$exec"
    for assignment in "${SERVICE_ENV[@]}"; do printf 'Environment="%s"\n' "$(systemd_escape "$assignment")"; done
    printf 'Restart=on-failure\nRestartSec=5\n'
    printf '# SIGTERM withdraws the mDNS record, then lets running tasks finish (--drain-timeout, 30 s)\n'
    printf 'KillSignal=SIGTERM\nTimeoutStopSec=45\n'
    if [ "$SYSTEM" = 1 ]; then
        printf 'User=%s\nGroup=%s\nWorkingDirectory=%s\n' "$SERVICE_USER" "$SERVICE_USER" "$SERVICE_HOME"
        printf 'Environment=HOME=%s\n' "$SERVICE_HOME"
    fi
    printf '\n[Install]\nWantedBy=%s\n' "$([ "$SYSTEM" = 1 ] && echo multi-user.target || echo default.target)"
}

launchd_plist() {
    local word assignment
    printf '<?xml version="1.0" encoding="UTF-8"?>\n'
    printf '<!DOCTYPE plist PUBLIC "-//Apple//DTD PLIST 1.0//EN" "http://www.apple.com/DTDs/PropertyList-1.0.dtd">\n'
    printf '<plist version="1.0">\n<dict>\n'
    printf '  <key>Label</key>\n  <string>%s</string>\n' "$LABEL"
    printf '  <key>ProgramArguments</key>\n  <array>\n'
    while IFS= read -r word; do printf '    <string>%s</string>\n' "$(xml_escape "$word")"; done < <(peer_command)
    printf '  </array>\n'
    printf '  <key>RunAtLoad</key>\n  <true/>\n'
    printf '  <key>KeepAlive</key>\n  <true/>\n'
    printf '  <key>ProcessType</key>\n  <string>Interactive</string>\n'
    printf '  <key>ExitTimeOut</key>\n  <integer>45</integer>\n'
    printf '  <key>EnvironmentVariables</key>\n  <dict>\n'
    for assignment in "${SERVICE_ENV[@]}"; do
        printf '    <key>%s</key>\n    <string>%s</string>\n' "${assignment%%=*}" "$(xml_escape "${assignment#*=}")"
    done
    printf '  </dict>\n'
    printf '  <key>StandardOutPath</key>\n  <string>%s</string>\n' "$(xml_escape "$LOG_DIR/peer.log")"
    printf '  <key>StandardErrorPath</key>\n  <string>%s</string>\n' "$(xml_escape "$LOG_DIR/peer.log")"
    printf '</dict>\n</plist>\n'
}

# ---- service managers ----------------------------------------------------------------------------

systemctl_() {  # systemctl for the user or the system unit
    if [ "$SYSTEM" = 1 ]; then run systemctl "$@"; else run systemctl --user "$@"; fi
}

systemctl_try() {
    if [ "$SYSTEM" = 1 ]; then try systemctl "$@"; else try systemctl --user "$@"; fi
}

launchd_domain() { printf 'gui/%s' "$(id -u)"; }

start_service() {
    if [ "$NO_START" = 1 ]; then
        say "not starting the service (--no-start)"
        return
    fi
    if [ "$TARGET_OS" = macos ]; then
        try launchctl bootout "$(launchd_domain)/$LABEL"
        run launchctl bootstrap "$(launchd_domain)" "$UNIT_FILE"
    else
        systemctl_ daemon-reload
        systemctl_ enable "$UNIT_NAME"
        systemctl_ restart "$UNIT_NAME"
        if [ "$SYSTEM" = 0 ]; then
            say "note: a user unit runs while you are logged in; to run it from boot: loginctl enable-linger $(id -un)"
        fi
    fi
}

stop_service() {
    if [ "$NO_START" = 1 ]; then
        return
    fi
    if [ "$TARGET_OS" = macos ]; then
        try launchctl bootout "$(launchd_domain)/$LABEL"
    else
        systemctl_try disable --now "$UNIT_NAME"
    fi
}

# ---- install and uninstall -----------------------------------------------------------------------

install_venv() {
    if [ -x "$VENV_PY" ]; then
        say "using the venv at $PREFIX"
    else
        if [ "$DRY_RUN" = 0 ]; then
            command -v "$PYTHON" >/dev/null 2>&1 || die "no '$PYTHON' found; pass --python PATH"
            "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
                || die "$PYTHON is $("$PYTHON" -c 'import platform; print(platform.python_version())'); GPUlayer needs 3.10 or newer"
        fi
        if [ "$SYSTEM_SITE" = 1 ]; then
            run "$PYTHON" -m venv --system-site-packages "$PREFIX"
        else
            run "$PYTHON" -m venv "$PREFIX"
        fi
        write_file "$PREFIX/$MARKER" 644 "made by scripts/install.sh; --uninstall removes this venv
"
    fi
    local spec=${FROM:-$CHECKOUT}
    if [ -z "$FROM" ] && [ ! -f "$CHECKOUT/pyproject.toml" ]; then
        die "$CHECKOUT is not a GPUlayer checkout; pass --from PATH|SPEC"
    fi
    if [ -e "$spec" ]; then
        spec=$(cd -P "$(dirname "$spec")" && pwd)/$(basename "$spec")
    fi
    if [ "${#PIP_ARGV[@]}" -gt 0 ]; then
        run "$VENV_PY" -m pip install --disable-pip-version-check --upgrade "${PIP_ARGV[@]}" "$spec"
    else
        run "$VENV_PY" -m pip install --disable-pip-version-check --upgrade "$spec"
    fi
    if [ "$DRY_RUN" = 0 ]; then
        # from /, so that a gpulayer folder in the current directory cannot stand in for the installed one
        (cd / && "$VENV_PY" -c 'import gpulayer; print("installed gpulayer", gpulayer.__version__, "at", gpulayer.__file__)')
    fi
}

install_key() {
    if [ -e "$KEY_FILE" ]; then
        say "keeping the cluster key $KEY_FILE"
    elif [ "$NO_KEY" = 1 ]; then
        say "warning: no cluster key at $KEY_FILE (--no-key): copy the cluster's key there, or the peer will not start" >&2
    else
        run "$PREFIX/bin/gpulayer" key init --path "$KEY_FILE"
    fi
    if [ "$SYSTEM" = 1 ]; then
        run chown "$SERVICE_USER:$SERVICE_USER" "$KEY_FILE"
        run chmod 600 "$KEY_FILE"
    fi
}

ensure_service_user() {
    if id -u "$SERVICE_USER" >/dev/null 2>&1; then
        say "using the existing user $SERVICE_USER"
    else
        run useradd --system --home-dir "$SERVICE_HOME" --create-home --shell /usr/sbin/nologin "$SERVICE_USER"
    fi
}

do_install() {
    if [ "$SYSTEM" = 1 ] && [ "$DRY_RUN" = 0 ] && [ "$(id -u)" != 0 ]; then
        die "--system needs root (sudo $PROG --system ...)"
    fi
    [ "$SYSTEM" = 0 ] || ensure_service_user
    install_venv
    install_key
    if [ "$NO_SERVICE" = 1 ]; then
        say "no service (--no-service): run the peer with $PREFIX/bin/gpulayer join"
        return
    fi
    if [ "$TARGET_OS" = macos ]; then
        run mkdir -p "$LOG_DIR"
        write_file "$UNIT_FILE" 644 "$(launchd_plist)
"
    else
        write_file "$UNIT_FILE" 644 "$(systemd_unit)
"
    fi
    start_service
    if [ "$TARGET_OS" = macos ]; then
        say "the peer's log: $LOG_DIR/peer.log"
    elif [ "$SYSTEM" = 1 ]; then
        say "the peer's log: journalctl -u $UNIT_NAME"
    else
        say "the peer's log: journalctl --user -u $UNIT_NAME"
    fi
}

do_uninstall() {
    stop_service
    remove "$UNIT_FILE"
    if [ "$NO_START" = 0 ] && [ "$TARGET_OS" = linux ]; then
        systemctl_try daemon-reload
    fi
    if [ -f "$PREFIX/$MARKER" ] || [ "$DRY_RUN" = 1 ]; then
        remove "$PREFIX"
    elif [ -e "$PREFIX" ]; then
        say "leaving $PREFIX in place: this script did not make it"
    fi
    if [ "$PURGE" = 1 ]; then
        remove "$KEY_FILE"
        [ "$TARGET_OS" != macos ] || remove "$LOG_DIR"
    elif [ -e "$KEY_FILE" ]; then
        say "kept the cluster key $KEY_FILE (--purge removes it)"
    fi
}

if [ "$DRY_RUN" = 1 ]; then
    say "dry run: nothing is changed; these are the actions, for $TARGET_OS"
fi
if [ "$UNINSTALL" = 1 ]; then
    do_uninstall
else
    do_install
fi
