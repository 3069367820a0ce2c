"""Fixtures for the adapter tests: tiny random Llamas (module-scoped, built once per file)."""

from __future__ import annotations

import pytest

from _adapter_models import tiny_llama


@pytest.fixture(scope="module")
def llama():
    return tiny_llama(seed=0)


@pytest.fixture(scope="module")
def llama6():
    """Six layers, so EAGLE-3 capture layers 2, 3, 3 exist."""
    return tiny_llama(seed=1, layers=6)
