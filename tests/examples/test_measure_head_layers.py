"""``examples/measure_head_layers.py``: the two-layer arm starts as the head it is made from."""

from __future__ import annotations

import runpy
from pathlib import Path

import torch

from rheoplan.models.eagle3 import Eagle3Config, Eagle3Head
from rheoplan.train.train import ttt_mask

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "measure_head_layers.py"


def _head() -> Eagle3Head:
    torch.manual_seed(0)
    cfg = Eagle3Config(vocab_size=40, draft_vocab_size=16, hidden_size=32, intermediate_size=48,
                       num_attention_heads=4, num_key_value_heads=2)
    head = Eagle3Head(cfg)
    head.set_vocab_map(torch.arange(16) * 2)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return head


def _ttt(head, steps: int = 2):
    """Two training-time-test steps over one packed row of 5 pairs: the shapes and masks
    the trainer runs, the second step fed the first step's hiddens."""
    torch.manual_seed(1)
    n = 5
    emb, feats = torch.randn(n, 32), torch.randn(n, 3 * 32)
    seq, local = torch.zeros(n, dtype=torch.long), torch.arange(n)
    past, hidden, outs = None, feats, []
    for k in range(1, steps + 1):
        h, past = head(emb, hidden, local + 1, past, ttt_mask(seq, local, k))
        outs.append(head.draft_logits(h))
        hidden = torch.cat([torch.zeros(1, 32), h[:-1]])
    return outs


def test_two_layer_arm_starts_as_the_one_layer_head():
    stacked = runpy.run_path(str(EXAMPLE), run_name="example_under_test")["stacked"]
    head = _head()
    two = stacked(head)
    assert sum(p.numel() for p in two.parameters()) > sum(p.numel() for p in head.parameters())
    for a, b in zip(_ttt(head), _ttt(two)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_two_layer_arm_moves_once_its_projections_are_not_zero():
    # the test above would pass if the second layer were never called: it must be
    stacked = runpy.run_path(str(EXAMPLE), run_name="example_under_test")["stacked"]
    head = _head()
    two = stacked(head)
    torch.nn.init.normal_(two.layer2.mlp.down_proj.weight, std=0.1)
    assert not torch.allclose(_ttt(head)[0], _ttt(two)[0])
