"""Where each way of bench/trainer_overhead.py spends its host time: a summary of a py-spy raw profile.

    py-spy record --nonblocking -r 1000 -f raw -o spy.txt -- python bench/trainer_overhead.py ...
    python bench/spy_summary.py spy.txt > spy_summary.txt

Each sample is charged to its way (the `run_<way>` frame of the stack) and, within it, to the innermost
frame of our own code (gpulayer/torch/, bench/trainer_overhead.py), so the time spent inside torch is
charged to the line of ours that called it. Prints, per way, the share of its samples for each such line.
"""
from __future__ import annotations

import argparse
import collections
import re

OURS = ("gpulayer/torch/", "trainer_overhead.py")
WAY = re.compile(r"^run_(\w+) ")


def summarize(lines, top: int) -> str:
    per_way: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        ways = [m.group(1) for f in frames if (m := WAY.match(f))]
        if not ways:
            continue
        ours = [f for f in frames if any(o in f for o in OURS)]
        per_way[ways[0]][ours[-1] if ours else "(other)"] += int(count)
    out = []
    for way, counter in per_way.items():
        total = sum(counter.values())
        out.append(f"== {way}: {total} samples")
        out += [f"{100 * n / total:6.2f}%  {frame}" for frame, n in counter.most_common(top)]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("raw", help="py-spy record -f raw output")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    with open(args.raw) as f:
        print(summarize(f, args.top))


if __name__ == "__main__":
    main()
