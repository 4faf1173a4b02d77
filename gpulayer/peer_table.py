"""The peer table that `gpulayer peers` and `gpulayer demo` print, from the rows of `gl.peers()`.

It lives on its own so that the CLI and the demo both use it without importing each other
(the CLI imports the demo; the demo imports nothing of the CLI).
"""

from __future__ import annotations

from typing import Any


def format_util(sample: dict[str, Any] | None) -> str:
    """A peer's measured utilisation: "gpu 63% cpu 12%" (one figure per GPU), "-" when unknown."""
    if not sample:
        return "-"
    gpus = [g["util_percent"] for g in sample["gpus"] if g["util_percent"] is not None]
    parts = [f"gpu {'/'.join(f'{u:.0f}' for u in gpus)}%"] if gpus else []
    if sample["cpu_percent"] is not None:
        parts.append(f"cpu {sample['cpu_percent']:.0f}%")
    return " ".join(parts) or "-"


def format_bytes(n: int | None) -> str:
    """Bytes held on a peer: "-" for none or unknown, else MiB or GiB."""
    if not n:
        return "-"
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


GREY, PLAIN = "\x1b[2m", "\x1b[0m"


def format_peers(rows: list[dict[str, Any]], grey: bool = False) -> str:
    """One line per row under a header, columns padded to their widest cell. VERIFIED says whether a
    handshake with the cluster key proved the row's peer at its address (else it is an advert's claim);
    FOUND how this submitter heard of it: mdns, static (GPULAYER_PEERS), gossip (ADR 0017) or cache. JOBS how
    the peer holds a job's processes: in a cgroup of the job's own, or its process group only (`--json` says why).
    A peer of another cluster (a row with "cluster") shows its ids only, greyed when `grey` (a terminal)."""
    header = ("NAME", "ADDRESS", "VERIFIED", "FOUND", "ACCEL", "MEMORY", "FRAMEWORKS", "SLOTS", "UTIL", "HELD", "JOBS",
              "STATE")
    lines = [header]
    for r in rows:
        if "cluster" in r:
            lines.append((r["peer_id"], "-", "no", "mdns", "?", "?", "?", "?", "-", "-", "?",
                          f"other cluster {r['cluster']}"))
            continue
        if "accelerator" not in r:  # an unreachable static peer
            lines.append((r["name"], r["address"], "no", "static", "?", "?", "?", "?", "-", "-", "?",
                          f"down: {r['error']}"))
            continue
        mem = r["device_memory_gb"]
        memory = f"{max(mem):g} GB {r['memory_kind']}" if mem else f"{r['ram_gb']:g} GB host"
        if len(mem) > 1:
            memory = f"{len(mem)}x{max(mem):g} GB {r['memory_kind']}"
        busy = "?" if r["busy"] is None else r["busy"]
        queued = f" +{r['queued']}q" if r.get("queued") else ""
        actors = f" ({r['actors']} held by actors)" if r.get("actors") else ""
        state = r["state"] if r["state"] == "up" else f"down: {r['error']}"
        frameworks = " ".join(f"{k} {v}" for k, v in sorted(r["frameworks"].items())) or "-"
        lines.append((r["name"], r["address"], "yes" if r.get("verified") else "no", r.get("source", "?"), r["accelerator"],
                      memory, frameworks,
                      f"{busy}/{r['slots']}{queued}{actors}", format_util(r.get("util")),
                      format_bytes(r.get("held_bytes")), r.get("job_isolation") or "?", state))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
    text = ["  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines]
    greyed = [False] + ["cluster" in r and grey for r in rows]
    return "\n".join(f"{GREY}{t}{PLAIN}" if g else t for t, g in zip(text, greyed, strict=True))
