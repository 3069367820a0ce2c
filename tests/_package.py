"""Where the package's modules live: ``planner/`` and ``kernels/`` install as
``rheoplan.planner`` and ``rheoplan.kernels`` (setup.py's ``package_dir``), so tests that
walk every module map folders to dotted names here instead of trusting the folder names."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"rheoplan": ROOT / "rheoplan", "rheoplan.planner": ROOT / "planner",
            "rheoplan.kernels": ROOT / "kernels"}


def modules(packages: dict[str, Path]) -> dict[str, Path]:
    """``{dotted name: file}`` of every module under ``packages`` (``{name: folder}``)."""
    out = {}
    for pkg, folder in packages.items():
        for f in sorted(folder.rglob("*.py")):
            parts = list(f.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([pkg] + parts)] = f
    return out
