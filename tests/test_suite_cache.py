"""The suite measures and caches apart from the user's cache (``tests/conftest.py``)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from rheoplan.costmodel import cache_dir


def test_the_suite_has_a_cache_of_its_own():
    kept = os.environ.get("RHEOPLAN_TEST_CACHE_DIR")
    d = cache_dir()
    if kept:
        assert d == Path(kept)
    else:  # a fresh temporary folder, not ~/.cache/rheoplan (nor $XDG_CACHE_HOME/rheoplan)
        assert d.name.startswith("rheoplan-test-cache-") and d.parent == Path(tempfile.gettempdir())
        assert d.is_dir()
