"""Fenced code blocks of the docs (docs/**/*.md and README.md): extraction, markers, and running them.

The convention (docs/testing.md, "Code blocks in these docs", says the same to writers):

* A ```bash (or sh, shell) block is run one command line at a time (backslash continuations
  joined, blank and comment lines skipped), each with `bash -eo pipefail -c`, and must exit 0.
  In a ```console block only the lines that start with "$ " are commands; the rest is output.
* A ```python block is run with `python -c`; a loopback peer of the same cluster is running,
  so `gl.run(...)` really runs.
* An HTML comment on the line right before the opening fence (blank lines between are allowed)
  changes that; several directives may share one comment, separated by ";":

    <!-- needs: mps -->            skipped unless the hardware is here (then it runs): mps, cuda;
                                   or lan, network, systemd, root, macos: run only when listed in
                                   GPULAYER_DOCS_HAVE (comma-separated), never by default
    <!-- not-run: output -->       not runnable: shown output, a file format, a fragment, a sketch
                                   (the text after the colon says why, and must be there)
    <!-- file: override.json -->   written to the page's working folder, for later blocks to use
    <!-- background: TEXT -->      (bash, one command) started in the background; the test waits
                                   until TEXT appears in its output, and stops it (SIGTERM) when
                                   the page's blocks are done
    <!-- continue -->              (python) run after the page's previous python blocks, as one program
    <!-- timeout: 300 -->          seconds per command (default 120)

* Any other block without a marker fails the test, and so does an unknown directive.

README.md is not the docs' to edit, so its blocks are matched by exact line text in
README_RULES below; the same markers work there too, and win over the rules.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
RUNNABLE = {"bash": "bash", "sh": "bash", "shell": "bash", "console": "console", "python": "python", "py": "python"}
AUTO_NEEDS = ("mps", "cuda")  # detected here; the others only through GPULAYER_DOCS_HAVE
OPT_IN_NEEDS = ("lan", "network", "systemd", "root", "macos")
DEFAULT_TIMEOUT = 120.0
NESTED_ENV = "GPULAYER_DOCS_BLOCK"  # set in every block's environment: tests/docs skips itself there
BACKGROUND_READY_TIMEOUT = 90.0

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\s]*)[^`]*$")
_MARKER = re.compile(r"^\s*<!--(?P<body>.*?)-->\s*$")
_DIRECTIVE = re.compile(r"^\s*(?P<name>[a-z-]+)\s*(?::\s*(?P<value>.*?))?\s*$")
_HOST_PORT = re.compile(r"(?<![\w.])(?P<host>[A-Za-z0-9][A-Za-z0-9.-]*):(?P<port>\d{2,5})(?![\w])")
_IPV4 = re.compile(r"(?<![\w.])(\d{1,3}(?:\.\d{1,3}){3})(?![\w.])")
DIRECTIVES = ("needs", "not-run", "file", "background", "continue", "timeout")

# README.md, matched by exact (stripped) line text. A rule names a line of a bash block ("run",
# "background", "skip") or any line of a block that the rule marks as a whole ("block").
README_RULES = {
    # the package is installed already: run the demo part alone
    "pip install . && gpulayer demo": ("run", "gpulayer demo"),
    # this IS the test suite (what .ci/run runs); running it here would recurse
    'pip install ".[test]" && python -m pytest -q': ("skip", "the test suite itself (.ci/run runs it)"),
    # the peer runs until stopped
    "gpulayer join                     # on every machine that offers its GPU (or: python -m gpulayer.peer)":
        ("background", "ready on port"),
    # the overview sketch: train/config/score are the reader's, and it asks for mps and cuda peers
    'gl.run(train, config, accelerator="mps")            # blocks, returns the result':
        ("block", "not-run: sketch with the reader's own functions and Mac/CUDA peers"),
}


@dataclass
class Block:
    path: Path  # the markdown file
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    directives: dict = field(default_factory=dict)
    readme_rule: tuple | None = None  # (kind, value) for a README.md block that the rules mark as a whole

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def kind(self) -> str | None:
        return RUNNABLE.get(self.lang)


class MarkerError(ValueError):
    pass


def parse_marker(line: str) -> dict | None:
    """The directives of an HTML comment line, or None when the line is no marker.

    Directives are separated by ";"; a part that does not start with a directive's name belongs
    to the value before it (a not-run reason may contain ";").
    """
    found = _MARKER.match(line)
    if not found:
        return None
    directives: dict[str, str] = {}
    last = None
    for part in found["body"].split(";"):
        d = _DIRECTIVE.match(part)
        if d and d["name"] in DIRECTIVES and (d["value"] is not None or part.strip() == d["name"]):
            last = d["name"]
            directives[last] = d["value"] or ""
        elif last is None:
            return None  # an ordinary comment, not ours
        else:
            directives[last] += ";" + part.rstrip()
    return directives or None


def blocks_of(path: Path) -> list[Block]:
    """Every fenced block of a markdown file, with the directives of the marker before it."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence, info = opening["indent"], opening["fence"], opening["info"]
        body = []
        j = i + 1
        while j < len(lines):
            closing = lines[j].strip()
            if closing.startswith(fence[0] * len(fence)) and set(closing) <= {fence[0]}:
                break
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        directives = parse_marker(lines[k]) if k >= 0 else None
        out.append(Block(path, i + 1, info.lower().lstrip("{.").rstrip("}"), "\n".join(body) + "\n",
                         directives or {}))
        i = j + 1
    if path.name == "README.md" and path.parent == ROOT:
        for block in out:
            if not block.directives:
                for line in block.text.splitlines():
                    rule = README_RULES.get(line.strip())
                    if rule and rule[0] == "block":
                        block.readme_rule = rule
    return out


def doc_files() -> list[Path]:
    return sorted(DOCS.rglob("*.md")) + [ROOT / "README.md"]


def all_blocks() -> list[Block]:
    return [b for path in doc_files() for b in blocks_of(path)]


def problems(block: Block) -> list[str]:
    """Why a block breaks the convention (empty when it is fine)."""
    d = block.directives
    why = []
    if block.readme_rule:
        return why
    if not d and block.kind is None:
        why.append(f"a ```{block.lang or '(no language)'} block is not runnable: mark it, e.g. "
                   "<!-- not-run: output --> or <!-- file: NAME -->")
    if "not-run" in d and not d["not-run"]:
        why.append("<!-- not-run: REASON --> needs its reason")
    for need in _split(d.get("needs", "")):
        if need not in AUTO_NEEDS + OPT_IN_NEEDS:
            why.append(f"unknown need {need!r} (known: {', '.join(AUTO_NEEDS + OPT_IN_NEEDS)})")
    if "needs" in d and not _split(d["needs"]):
        why.append("<!-- needs: ... --> names nothing")
    if "file" in d and (not d["file"] or "/" in d["file"] or d["file"].startswith(".")):
        why.append("<!-- file: NAME --> needs a plain file name")
    if "background" in d and (block.kind != "bash" or len(commands(block)) != 1 or not d["background"]):
        why.append("<!-- background: TEXT --> is for a bash block of one command, with the TEXT to wait for")
    if "continue" in d and block.kind != "python":
        why.append("<!-- continue --> is for python blocks")
    if "timeout" in d:
        try:
            float(d["timeout"])
        except ValueError:
            why.append(f"bad timeout {d['timeout']!r}")
    needs = set(_split(d.get("needs", "")))
    if block.kind and not {"not-run", "file"} & set(d):
        if "lan" not in needs:
            why += _network_problems(block.text)
        if not needs & {"network", "systemd", "root"}:
            why += _environment_problems(block)
    return why


def _environment_problems(block: Block) -> list[str]:
    """Runnable commands may not change the environment the tests run in, nor run the whole suite."""
    why = []
    for _, command, _ in steps(block) if block.kind in ("bash", "console") else []:
        if re.search(r"\bpip3?\s+install\b|\bpip\b.*\binstall\b", command):
            why.append(f"`{command}` would install into the test environment: mark it <!-- not-run: ... -->")
        if "pytest" in command and not re.search(r"tests/(unit|resources|integration|torch|hardware)/\S", command):
            why.append(f"`{command}` runs more than a named test file of tests/unit, resources, integration, "
                       "torch or hardware: mark it <!-- not-run: ... -->")
    return why


def _network_problems(text: str) -> list[str]:
    """Runnable blocks may only name loopback: nothing here may reach another address."""
    why = []
    for ip in _IPV4.findall(text):
        if not ip.startswith("127."):
            why.append(f"names {ip}: a runnable block may only use loopback (mark it <!-- needs: lan -->)")
    for found in _HOST_PORT.finditer(text):
        host = found["host"]
        if not (host.startswith("127.") or host == "localhost" or _IPV4.fullmatch(host) or host.isdigit()):
            why.append(f"names {host}:{found['port']}: a runnable block may only use loopback "
                       "(mark it <!-- needs: lan -->)")
    return why


def _split(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def commands(block: Block) -> list[str]:
    """The command lines of a bash or console block."""
    lines = block.text.splitlines()
    if block.kind == "console":
        lines = [line[2:] for line in lines if line.startswith("$ ")]
    out, current = [], ""
    for line in lines:
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        out.append(current + line)
        current = ""
    if current:
        out.append(current)
    return out


def steps(block: Block) -> list[tuple[str, str, str]]:
    """(action, command, ready text) for each command of a bash or console block; action is "run" or
    "background". README.md's lines go through README_RULES ("skip" drops a line)."""
    out = []
    for command in commands(block):
        action, ready = "run", ""
        if block.path.name == "README.md" and block.path.parent == ROOT and not block.directives:
            kind, value = README_RULES.get(command.strip(), ("run", None))
            if kind == "skip":
                continue
            if kind == "run":
                command = value or command
            else:
                action, ready = "background", value
        if "background" in block.directives:
            action, ready = "background", block.directives["background"]
        out.append((action, command, ready))
    return out


# ---- what is present here ---------------------------------------------------------------------------

def present_needs() -> set[str]:
    have = set(_split(os.environ.get("GPULAYER_DOCS_HAVE", "")))
    try:
        import torch

        if torch.cuda.is_available():
            have.add("cuda")
        if torch.backends.mps.is_available():
            have.add("mps")
    except ImportError:
        pass
    return have


def skip_reason(block: Block, have: set[str]) -> str | None:
    """Why the block is not run here, or None when it runs."""
    if block.readme_rule:
        return block.readme_rule[1]
    d = block.directives
    if "not-run" in d:
        return f"not-run: {d['not-run']}"
    missing = [n for n in _split(d.get("needs", "")) if n not in have]
    if missing:
        return f"needs {', '.join(missing)}, not present here"
    return None


# ---- running ----------------------------------------------------------------------------------------

class Page:
    """One markdown file's blocks, run in order in a working folder of their own, with a private home."""

    def __init__(self, path: Path, workdir: Path, base_env: dict):
        self.path = path
        self.workdir = workdir
        home = workdir / "home"
        for sub in ("config", "cache"):
            (home / sub).mkdir(parents=True, exist_ok=True)
        self.env = {**base_env, "HOME": str(home), "XDG_CONFIG_HOME": str(home / "config"),
                    "XDG_CACHE_HOME": str(home / "cache"), NESTED_ENV: "1"}
        self.background: list[tuple[subprocess.Popen, Path, str]] = []
        for block in blocks_of(path):  # later blocks may read these files, whichever block runs first
            if "file" in block.directives:
                (workdir / block.directives["file"]).write_text(block.text)

    def run(self, block: Block) -> None:
        timeout = float(block.directives.get("timeout") or DEFAULT_TIMEOUT)
        if "file" in block.directives:
            (self.workdir / block.directives["file"]).write_text(block.text)
            if block.kind != "bash" or "background" not in block.directives:
                return
        if block.kind == "python":
            self._python(block, timeout)
            return
        for action, command, ready in steps(block):
            if action == "background":
                self._start_background(block, command, ready)
            else:
                self._command(block, command, timeout)

    def _command(self, block: Block, command: str, timeout: float) -> None:
        out = _run(["bash", "-eo", "pipefail", "-c", command], self.workdir, self.env, timeout, block.where)
        if out.returncode != 0:
            raise AssertionError(f"{block.where}: `{command}` exited {out.returncode}\n"
                                 f"--- stdout\n{out.stdout[-3000:]}\n--- stderr\n{out.stderr[-3000:]}")

    def _python(self, block: Block, timeout: float) -> None:
        code = block.text
        if "continue" in block.directives:
            earlier = [b for b in blocks_of(self.path) if b.kind == "python" and b.line < block.line]
            start = max((i for i, b in enumerate(earlier) if "continue" not in b.directives), default=0)
            code = "".join(b.text for b in earlier[start:]) + code
        out = _run([sys.executable, "-c", code], self.workdir, self.env, timeout, block.where)
        if out.returncode != 0:
            raise AssertionError(f"{block.where}: the python block exited {out.returncode}\n"
                                 f"--- stdout\n{out.stdout[-3000:]}\n--- stderr\n{out.stderr[-4000:]}")

    def _start_background(self, block: Block, command: str, ready: str) -> None:
        log = self.workdir / f"background-{block.line}.log"
        with open(log, "wb") as f:
            proc = subprocess.Popen(["bash", "-c", command], cwd=self.workdir, env=self.env, stdout=f,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.background.append((proc, log, command))
        deadline = time.monotonic() + BACKGROUND_READY_TIMEOUT
        while ready not in log.read_text(errors="replace"):
            if proc.poll() is not None:
                raise AssertionError(f"{block.where}: `{command}` exited {proc.returncode} before printing "
                                     f"{ready!r}:\n{log.read_text(errors='replace')[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{block.where}: `{command}` did not print {ready!r} within "
                                     f"{BACKGROUND_READY_TIMEOUT:.0f} s:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.05)

    def close(self) -> list[str]:
        """Stop the background processes (SIGTERM, then SIGKILL); returns complaints about them."""
        complaints = []
        for proc, log, command in self.background:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    complaints.append(f"`{command}` did not stop within 30 s of SIGTERM")
            elif proc.returncode != 0:
                complaints.append(f"`{command}` exited {proc.returncode} while in the background:\n"
                                  f"{log.read_text(errors='replace')[-2000:]}")
        self.background.clear()
        return complaints


def _run(argv: list[str], cwd: Path, env: dict, timeout: float, where: str) -> subprocess.CompletedProcess:
    """Run in a process group of its own; on timeout the whole group is killed, children included."""
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, err = proc.communicate()
        raise AssertionError(f"{where}: `{argv[-1][:200]}` ran past {timeout:.0f} s\n--- stdout\n{out[-3000:]}\n"
                             f"--- stderr\n{err[-3000:]}") from None
    finally:
        _kill_group(proc)  # anything it left behind in its group
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
