"""``examples/measure_head_layers.py``: the two-layer arm starts as the head it is made from."""

from __future__ import annotations

import runpy
from pathlib import Path

import torch

from rheoplan.models.eagle3 import Eagle3Config, Eagle3Head
from rheoplan.train.train import Batch, ttt_forward

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
    """The trainer's training-time test (``ttt_forward``) over two packed rows of 3 and 4
    pairs: the logits of each step, as the example's training sees them."""
    torch.manual_seed(1)
    seq = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    local = torch.tensor([0, 1, 2, 0, 1, 2, 3])
    n = seq.numel()
    b = Batch(tokens=torch.randint(0, 40, (n,)), feats=torch.randn(n, 3 * 32), positions=local + 1, seq=seq,
              local=local, topk_ids=torch.zeros(n, 1, dtype=torch.long), topk_logp=torch.zeros(n, 1),
              weight=torch.ones(n), response=torch.ones(n, dtype=torch.bool))
    return [head.draft_logits(h) for h in ttt_forward(head, torch.randn(40, 32), b, steps)]


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
