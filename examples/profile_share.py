"""Shares of a py-spy profile: which functions a decode loop's samples fall in.

``py-spy record -f raw`` writes one line per distinct stack: ``frame;frame;...;frame COUNT``.
This keeps the stacks that pass through ``--root`` (a function name, e.g. ``_decode`` for
the batch-1 loop), optionally drops those that also pass through ``--exclude``, and prints
each function's inclusive share of them (a function is counted once per stack) and the
lines where the samples sit themselves (self time). Proportions are what a profile on a
busy machine still gives; absolute times are not.

Usage (docs/troubleshooting.md, "Where does a step's time go?"):
    py-spy record -r 100 -f raw -o prof.txt -- python -m rheoplan.cli generate -n 32 --dtype bfloat16
    python examples/profile_share.py prof.txt --root _decode [--exclude draft_fn] [--top 40]
"""

from __future__ import annotations

import argparse
from collections import Counter


def _name(frame: str) -> str:
    """``func (path:line)`` -> ``func (path)``: inclusive shares per function, not per line."""
    return frame.split(":")[0] + ")" if " (" in frame else frame


def shares(lines, root: str, exclude: str | None = None) -> tuple[int, Counter, Counter]:
    """(samples under ``root``, inclusive samples per function, self samples per line)."""
    total, incl, own = 0, Counter(), Counter()
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        names = [f.split(" (")[0] for f in frames]
        hit = [i for i, n in enumerate(names) if n.split(".")[-1] == root or n == root]
        if not hit or (exclude and any(n.split(".")[-1] == exclude or n == exclude for n in names)):
            continue
        n = int(count)
        total += n
        sub = frames[hit[0]:]
        own[sub[-1]] += n
        for f in dict.fromkeys(_name(f) for f in sub[1:]):
            incl[f] += n
    return total, incl, own


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw", help="a py-spy -f raw output file")
    ap.add_argument("--root", default="_decode", help="keep stacks through this function (default _decode)")
    ap.add_argument("--exclude", default=None, help="drop stacks through this function")
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args()
    with open(a.raw) as f:
        total, incl, own = shares(f, a.root, a.exclude)
    if total == 0:
        raise SystemExit(f"no stack passes through {a.root!r} in {a.raw}")
    print(f"{total} samples under {a.root}" + (f", without {a.exclude}" if a.exclude else ""))
    print("-- inclusive share per function")
    for k, v in incl.most_common(a.top):
        print(f"{100 * v / total:6.1f}%  {k}")
    print("-- self share per line")
    for k, v in own.most_common(a.top // 2):
        print(f"{100 * v / total:6.1f}%  {k}")


if __name__ == "__main__":
    main()
