"""Fixtures for the oracle tests that compare with transformers' own sampling law."""

from __future__ import annotations

import importlib.util
import os

import pytest


def _decode_models():
    """``tests/rheoplan/_decode_models.py`` (the shared tiny models), loaded by path: this
    directory is not a package and pytest puts only this directory on ``sys.path``."""
    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "_decode_models.py")
    spec = importlib.util.spec_from_file_location("_decode_models", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def generate_processors():
    """``f(sampling, extra=()) -> LogitsProcessorList``: what ``generate`` itself builds for
    those settings (on a tiny Llama; the list does not depend on the model's weights)."""
    pytest.importorskip("transformers")
    dm = _decode_models()
    model = dm.tiny_llama(0)
    return lambda sampling, extra=(): dm.generate_processors(model, sampling, extra)
