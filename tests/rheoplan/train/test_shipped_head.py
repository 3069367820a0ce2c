"""The shipped SmolLM2 head loads strictly through the project's loader (no SmolLM2 needed)."""

from __future__ import annotations

import os

import torch

from rheoplan.models.eagle3 import read_eagle3

ASSET = os.path.join(os.path.dirname(__file__), "..", "..", "..", "rheoplan", "assets", "smollm2-eagle3")


def test_shipped_head_loads_and_is_small():
    head = read_eagle3(ASSET)
    cfg = head.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.target_hidden_size, cfg.draft_vocab_size) == (49152, 576, 576, 8192)
    ids = head.target_ids()
    assert len(set(ids.tolist())) == 8192 and torch.equal(head.t2d.nonzero().flatten(), ids.sort().values)
    assert bool(head.t2d[2])  # <|im_end|> (EOS of the chat template) is draftable
    assert os.path.getsize(os.path.join(ASSET, "model.safetensors")) <= 30 * 2**20
    for name in ("config.json", "MODEL_CARD.md"):
        assert os.path.exists(os.path.join(ASSET, name))
