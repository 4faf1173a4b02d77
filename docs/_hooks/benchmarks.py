"""MkDocs hook: the figures of docs/benchmarks.md come from bench/results/*.json at build time.

`<!-- bench: overhead -->` and `<!-- bench: trainer -->` in a page are replaced by tables made
from the JSON files, so the page never goes stale; the PNG plots next to them are copied into
the site as bench/results/NAME.png. A JSON file of a shape this hook does not know is a build
warning (an error under `mkdocs build --strict`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from mkdocs.structure.files import File

log = logging.getLogger("mkdocs.hooks.benchmarks")
RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
SITE_DIR = "bench/results"
_shown: set[str] = set()  # the PNGs placed on the page so far; `others` shows the rest


def on_files(files, config):
    for png in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"{SITE_DIR}/{png.name}", abs_src_path=str(png)))
    return files


def on_page_markdown(markdown, page, config, files):
    if "<!-- bench:" not in markdown:
        return markdown
    _shown.clear()
    markdown = markdown.replace("<!-- bench: overhead -->", _overhead())
    markdown = markdown.replace("<!-- bench: peers -->", _peers())
    markdown = markdown.replace("<!-- bench: trainer -->", _trainer())
    return markdown.replace("<!-- bench: others -->", _others())


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        log.warning("benchmarks: cannot read %s: %s", path, exc)
        return None


def _png(name: str, alt: str) -> str:
    if not (RESULTS / name).exists():
        return ""
    _shown.add(name)
    return f"\n![{alt}]({SITE_DIR}/{name})\n"


def _ms(value) -> str:
    return "–" if value is None else f"{value:.3f} ms" if value < 1 else f"{value:.1f} ms"


def _spread(bounds, fmt: str) -> str:
    """' (min–max)' of repeated runs, when the result file has them."""
    return f" ({fmt.format(bounds[0])}–{fmt.format(bounds[1])})" if bounds else ""


def _overhead() -> str:
    path = RESULTS / "overhead.json"
    if not path.exists():
        return ("*`bench/results/overhead.json` is not in this checkout: run `python bench/overhead.py` "
                "to make it (and `overhead.png`).*\n")
    data = _load(path)
    try:
        m, raw, glr, ray, aead = data["machine"], data["raw"], data["gpulayer"], data.get("ray"), data.get("aead")
        fresh = glr["discovery"]["fresh_submitter"]
        rows = [
            ("trivial `gl.run` round trip, p50", _ms(glr["latency"]["p50_ms"]), _ms(raw["latency"]["p50_ms"])),
            ("trivial `gl.run` round trip, p99", _ms(glr["latency"]["p99_ms"]), _ms(raw["latency"]["p99_ms"])),
            ("p50 over the raw floor of the same round (median of rounds, range)",
             f"{glr['p50_over_raw']:.2f}x{_spread(glr['p50_over_raw_range'], '{:.2f}')}", "1"),
            (f"throughput: {glr['submits']} `gl.submit` calls, then wait for all",
             f"{glr['tasks_per_s']:,.0f} tasks/s{_spread(glr.get('tasks_per_s_range'), '{:,.0f}')}", "–"),
            ("256 MiB array echoed back (GB/s, both directions)",
             f"{glr['bulk_gb_per_s']:.2f}{_spread(glr.get('bulk_gb_per_s_range'), '{:.2f}')}",
             f"{raw['bulk_gb_per_s']:.2f}"),
            ("a new peer: from its start command to ready / to seen by a browsing client",
             f"{glr['discovery']['peer_ready_s']:.2f} s / {glr['discovery']['browser_sees_new_peer_s']:.2f} s", "–"),
            ("fresh process: start, discover by mDNS, first result (median of 5)",
             f"{fresh['mdns']['median_process_s']:.2f} s", "–"),
            ("fresh process with the peer cache (median of 5)", f"{fresh['cache']['median_process_s']:.2f} s", "–"),
        ]
        free = data.get("free")
        if free and data.get("layout") != "free":
            gf, rf = free["gpulayer"], free["raw"]
            rows.append(("the same rounds, processes where the OS puts them: p50, and its ratio to the floor by round",
                         f"{_ms(gf['latency']['p50_ms'])}, {gf['p50_over_raw']:.2f}x"
                         f"{_spread(gf['p50_over_raw_range'], '{:.2f}')}",
                         f"{_ms(rf['latency']['p50_ms'])}{_spread(rf['latency']['p50_ms_range'], '{:.3f}')}"))
        if aead:
            rows.append((f"the secure channel's {aead['aead']} alone: per task / per 256 MiB echo "
                         "(between hosts; the local echo goes by shared memory)",
                         f"{aead['per_task_us']:.1f} µs / {aead['bulk_seconds'] * 1e3:.0f} ms", "–"))
        if ray:
            rows.append((f"Ray {ray['version']}: trivial task p50 / tasks per s",
                         f"{_ms(ray['latency']['p50_ms'])} / {ray['tasks_per_s']:,.0f}"
                         f"{_spread(ray.get('tasks_per_s_range'), '{:,.0f}')}", "–"))
        targets = data["summary"]["targets"]
        head = (f"Measured on `{m['host']}` ({m['cpus']} CPUs, Python {m['python']}, {m['platform']}) "
                f"on {m['date'][:10]}, with {glr['latency']['n']} sequential calls, CPU layout "
                f"`{data.get('layout', 'free')}`. "
                f"Source: `bench/results/overhead.json`.\n\n")
    except (KeyError, TypeError) as exc:
        log.warning("benchmarks: overhead.json has an unknown shape (%r); update docs/_hooks/benchmarks.py", exc)
        return "*`bench/results/overhead.json` has a shape this page does not know.*\n"
    table = ["| measure | GPUlayer | raw socket floor |", "| --- | --- | --- |"]
    table += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    met = ", ".join(f"`{name}` {'met' if ok else '**not met**'}" for name, ok in targets.items())
    return head + "\n".join(table) + f"\n\nTargets of the benchmark script: {met}.\n" + \
        _png("overhead.png", "overhead plot")


def _trainer() -> str:
    paths = sorted(RESULTS.glob("trainer_overhead*.json"))
    if not paths:
        return ("*No `bench/results/trainer_overhead*.json` in this checkout: run "
                "`python bench/trainer_overhead.py --device cpu` (or cuda, mps).*\n")
    table = ["| file | device | machine | date | steps an epoch | hand-written loop | `glt.Trainer` | Lightning | glt / raw |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    config = None
    for path in paths:
        data = _load(path)
        try:
            m, res = data["machine"], data["results"]
            config = config or data["config"]

            def cell(run: dict) -> str:
                if "skipped" in run:
                    return "not run"
                return f"{run['ms_per_step_median']:.1f} ms (min {run['ms_per_step_min']:.1f})"

            ratio = data.get("ratios", {}).get("glt_over_raw")
            machine = f"{m['gpu']}, torch {m['torch']}" if m.get("gpu") else f"{m['cpu_count']} CPUs, torch {m['torch']}"
            table.append(f"| `{path.name}` | {data['device']} | {machine} | {m['date'][:10]} | "
                         f"{data['config'].get('steps_per_epoch')} | {cell(res['raw'])} | {cell(res['glt'])} | {cell(res['lightning'])} | "
                         f"{'–' if ratio is None else f'{ratio:.2f}'} |")
        except (KeyError, TypeError) as exc:
            log.warning("benchmarks: %s has an unknown shape (%r); update docs/_hooks/benchmarks.py", path.name, exc)
    out = "\n".join(table) + "\n"
    if config:
        out += (f"\nPer-step times are medians over timed epochs (min in brackets). Model: {config.get('model')}; "
                f"optimizer: {config.get('optimizer')}; batch size {config.get('batch_size')}, "
                f"precision {config.get('precision')}.\n")
    for path in paths:
        out += _png(path.with_suffix(".png").name, f"{path.stem} plot")
    return out


def _peer_reports() -> list[Path]:
    """`gpulayer bench --json` reports (bench/lan_bench.py writes the same)."""
    out = []
    for path in sorted(RESULTS.glob("*.json")):
        data = _load(path)
        if isinstance(data, dict) and {"peers", "settings", "submitter"} <= data.keys():
            out.append(path)
    return out


def _peers() -> str:
    paths = _peer_reports()
    if not paths:
        return ("*No `gpulayer bench --json` report in `bench/results/` in this checkout: run "
                "`python bench/lan_bench.py --json bench/results/lan_bench.json --plot bench/results/lan_bench.png`.*\n")
    out = []
    for path in paths:
        data = _load(path)
        try:
            sub = data["submitter"]
            out.append(f"`bench/results/{path.name}`: from `{sub['host']}` ({sub['platform']}, Python {sub['python']}), "
                       f"{data['date'][:10]}{', quick settings' if data['settings'].get('quick') else ''}.\n")
            out.append("| peer | accelerator | device | p50 / p99 round trip | upload / download | matmul float32 |")
            out.append("| --- | --- | --- | --- | --- | --- |")
            for p in data["peers"]:
                lat, bw = p["latency"], p["bandwidth"]
                mm = ", ".join(f"{m['framework']}/{m.get('device', '?')} {m['tflops']:.3g} TFLOPS (n={m['size']})"
                               if "tflops" in m else f"{m['framework']}: failed" for m in p["matmul"]) or "–"
                out.append(f"| {p['name']} | {p['accelerator']} | {p['device']} | {_ms(lat['p50_ms'])} / "
                           f"{_ms(lat['p99_ms'])} | {bw['upload_gb_per_s']:.2f} / {bw['download_gb_per_s']:.2f} GB/s "
                           f"({bw['bytes'] >> 20} MiB) | {mm} |")
            out.append(_png(path.with_suffix(".png").name, f"{path.stem} plot"))
        except (KeyError, TypeError) as exc:
            log.warning("benchmarks: %s has an unknown shape (%r); update docs/_hooks/benchmarks.py", path.name, exc)
    return "\n".join(out) + "\n"


def _others() -> str:
    known = {"overhead.json", *(p.name for p in RESULTS.glob("trainer_overhead*.json")),
             *(p.name for p in _peer_reports())}
    rows = []
    for path in sorted(RESULTS.glob("*.json")):
        if path.name in known:
            continue
        data = _load(path)
        if not isinstance(data, dict):
            continue
        machine = data.get("machine")
        date = str(data.get("date") or data.get("written") or data.get("when")
                   or (machine.get("date") if isinstance(machine, dict) else "") or "")
        line = f"- `bench/results/{path.name}`{f' ({date[:10]})' if date else ''}"
        if isinstance(data.get("what"), str):
            line += f": {data['what']}"
        totals = data.get("totals") or data.get("summary")
        if isinstance(totals, dict):
            flat = [f"{k.replace('_', ' ')} {v}" for k, v in totals.items() if isinstance(v, (int, float, str))]
            line += ". Totals: " + ", ".join(flat) if flat else ""
        else:
            line += ". Sections: " + ", ".join(f"`{k}`" for k in list(data)[:12])
        rows.append(line + ".")
    out = ("\n".join(rows) + "\n") if rows else "*None in this checkout.*\n"
    for png in sorted(RESULTS.glob("*.png")):
        if png.name not in _shown:
            out += _png(png.name, png.stem)
    return out
