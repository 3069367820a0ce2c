"""Run a script with ``rheoplan`` imported from another checkout of this repository.

A before/after measurement of a change to the loop's bookkeeping must run the old code and
the new one on the same machine, alternating, because the machine's speed drifts by more
than the change (docs/results.md). The installed package maps ``rheoplan.planner`` and
``rheoplan.kernels`` to the working tree's ``planner/`` and ``kernels/`` (setup.py), so
putting an old checkout on ``sys.path`` is not enough: this script puts a finder in front
of the installed one that takes ``rheoplan``, ``rheoplan.planner`` and ``rheoplan.kernels``
from DIR, then runs SCRIPT as ``__main__`` with the remaining arguments.

Usage (an old commit in a worktree, then the new code and the old alternately):

    git worktree add /tmp/base <commit>
    python examples/with_checkout.py /tmp/base examples/step_phases.py --methods default --out base.json
    python examples/step_phases.py --methods default --out new.json --compare base.json

The second run says whether every decode gave the same tokens (docs/results.md, "Lean
steps, sixteenth round", was measured this way).
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.util
import runpy
import sys
from pathlib import Path

#: package -> folder of the checkout it comes from (setup.py's mapping)
PACKAGES = {"rheoplan.planner": "planner", "rheoplan.kernels": "kernels", "rheoplan": "rheoplan"}


class CheckoutFinder(importlib.abc.MetaPathFinder):
    """Finds ``rheoplan`` and its mapped subpackages in ``root`` (longest prefix first)."""

    def __init__(self, root: Path):
        self.root = root

    def find_spec(self, name, path=None, target=None):
        for pkg, folder in PACKAGES.items():
            if name != pkg and not name.startswith(pkg + "."):
                continue
            base = self.root / folder / Path(*name[len(pkg):].lstrip(".").split(".")) if name != pkg \
                else self.root / folder
            if base.is_dir():
                return importlib.util.spec_from_file_location(name, base / "__init__.py",
                                                              submodule_search_locations=[str(base)])
            if base.with_suffix(".py").exists():
                return importlib.util.spec_from_file_location(name, base.with_suffix(".py"))
            return None
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkout", help="root of the other checkout (holds rheoplan/, planner/, kernels/)")
    ap.add_argument("script", help="the script to run, e.g. examples/step_phases.py")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    a = ap.parse_args()
    root = Path(a.checkout).resolve()
    missing = [f for f in PACKAGES.values() if not (root / f / "__init__.py").exists()]
    if missing:
        raise SystemExit(f"checkout={a.checkout}: no {', '.join(missing)} package there: allowed the root of a "
                         "checkout of this repository")
    if "rheoplan" in sys.modules:
        raise SystemExit("rheoplan is imported already: run this script directly, not from Python")
    sys.meta_path.insert(0, CheckoutFinder(root))
    import rheoplan

    print(f"rheoplan from {Path(rheoplan.__file__).parent}", file=sys.stderr)
    sys.argv = [a.script] + a.args
    runpy.run_path(a.script, run_name="__main__")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
