"""The kernels: numba (CPU) and Triton implementations of the planner's passes and the
verifier, each beside its torch reference (docs/kernels.md).

Importing this package first makes numba's on-disk cache (``@njit(cache=True)``) safe
across files. numba reuses a compiled kernel while the source file that *defines* it is
unchanged; it does not look at the kernels it calls from other files
(``kernels/gumbel.py``, ``kernels/philox.py``) nor at the module constants it compiled
in (``rheoplan.distributions.RESIDUAL_EPS``, ``rheoplan.verify.FILTER_SLACK``). So after
an edit, a broken variant for a mutation check, or an upgrade that changed only such a
file (pip leaves ``__pycache__`` behind), a cached caller would keep running the old
code: wrong draws that no error reports. Here every kernel's cache entry is also keyed by
``source_digest()``, a hash of every kernel source and of those constants' modules, so
any change recompiles every kernel once, as it is next used (a one-prompt decode with every
cached kernel deleted took 1.5 s longer on the 2-core CPU than with them).

Imported as the top-level ``kernels`` (``python -m`` from a checkout's root puts this
folder first on ``sys.path``), it hands that name to Hugging Face's ``kernels`` package,
which transformers imports (``_hand_over_the_name``).
"""

from __future__ import annotations

import hashlib
import sys
import types
from functools import lru_cache
from pathlib import Path

_ROOT = Path(__file__).resolve().parent


def _hand_over_the_name() -> None:
    """Run when this folder was imported as the top-level ``kernels``: make that name
    Hugging Face's ``kernels`` package, found on ``sys.path`` without the checkout's root,
    or, where it is not installed, an empty stand-in that reads as a namespace-package
    shadow (no ``__file__``, no ``__version__``).

    ``python -m pytest`` (or any ``python -m``) from a checkout's root puts the working
    directory first on ``sys.path``, so ``import kernels`` finds this folder. transformers
    5.25 depends on Hugging Face's ``kernels`` and imports it when loading a model (its
    hub-kernels integration); getting this folder instead, it failed with "cannot import
    name 'CUDAProperties' from 'kernels'". The import system returns whatever
    ``sys.modules["kernels"]`` holds once this module's code has run, so putting the real
    package there hands the import over.

    Where Hugging Face's ``kernels`` is not installed, transformers still finds this folder
    (``importlib.util.find_spec``), finds no version metadata for it, and imports it to read
    its version; it counts a module with neither ``__file__`` nor ``__version__`` as a
    namespace package shadowing the name, not an install, and carries on without hub
    kernels. Raising ``ModuleNotFoundError`` here instead broke every model class import
    (transformers 5.17 on the GPU machine: "Could not import module 'LlamaConfig'"), so the
    stand-in is such a module: ``from kernels import x`` still fails, as for a namespace
    package."""
    import importlib.machinery
    import importlib.util

    checkout = _ROOT.parent
    path = [p for p in sys.path if Path(p or ".").resolve() != checkout]
    spec = importlib.machinery.PathFinder.find_spec("kernels", path)
    if spec is None or spec.loader is None:
        shadow = types.ModuleType("kernels", f"Not Hugging Face's kernels (not installed): the folder {_ROOT} "
                                             "of a rheoplan checkout is rheoplan.kernels, not a top-level package.")
        shadow.__file__ = None
        shadow.__path__ = []
        sys.modules["kernels"] = shadow
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop("kernels", None)
        raise


if __name__ == "kernels":
    _hand_over_the_name()
#: modules of the ``rheoplan`` package whose constants the kernels compile in
CONSTANT_MODULES = ("distributions.py", "verify.py")


def digest_sources(files) -> str:
    """sha256 over ``files``, ``(name, path)`` pairs in the order given: each name and its
    file's bytes (names, not paths: a moved checkout keeps its caches)."""
    h = hashlib.sha256()
    for name, path in files:
        h.update(name.encode() + b"\0")
        h.update(Path(path).read_bytes())
    return h.hexdigest()


def source_files() -> list[tuple[str, Path]]:
    """The files a kernel's compiled code depends on, as ``(name, path)``: every ``.py`` of
    this package and ``CONSTANT_MODULES`` of ``rheoplan`` (found where it is installed,
    also when the two folders are apart, as in an editable install)."""
    own = [(p.relative_to(_ROOT).as_posix(), p) for p in sorted(_ROOT.rglob("*.py"))]
    pkg = Path(sys.modules["rheoplan"].__path__[0]) if "rheoplan" in sys.modules else _ROOT.parent
    return own + [(f"rheoplan/{name}", pkg / name) for name in CONSTANT_MODULES if (pkg / name).exists()]


@lru_cache(maxsize=1)
def source_digest() -> str:
    """``digest_sources(source_files())``, once per process (read when numba sets up a
    kernel's cache, at its decoration)."""
    return digest_sources(source_files())


def _guarded(base):
    """``base`` (a numba cache locator) for kernels of this package only, its source stamp
    extended by ``source_digest()``: a cached kernel is reused only while no kernel source
    changed."""

    class Locator(base):
        @classmethod
        def from_function(cls, py_func, py_file):
            try:
                Path(py_file).resolve().relative_to(_ROOT)
            except (ValueError, OSError):
                return None  # not ours: numba's own locators decide
            return super().from_function(py_func, py_file)

        def get_source_stamp(self):
            return (super().get_source_stamp(), source_digest())

    Locator.__name__ = Locator.__qualname__ = f"Rheoplan{base.__name__}"
    return Locator


def _install_cache_guard() -> bool:
    """Put the guarded locators in front of numba's (the same order: a user's
    ``NUMBA_CACHE_DIR``, then ``__pycache__``, then the user-wide folder). Returns False,
    changing nothing, where this numba lays its cache out otherwise."""
    try:
        from numba.core import caching
        bases = (caching.UserProvidedCacheLocator, caching.InTreeCacheLocator, caching.UserWideCacheLocator)
        classes = caching.CacheImpl._locator_classes
    except (ImportError, AttributeError):
        return False
    if any(getattr(c, "__name__", "").startswith("Rheoplan") for c in classes):
        return True
    classes[:0] = [_guarded(b) for b in bases]
    return True


CACHE_GUARDED = __name__ != "kernels" and _install_cache_guard()  # not twice from a top-level import
