"""The head's training precision by measurement (``rheoplan.train.precision``): the timing
leaves the head alone, the faster precision is kept and cached, and a remeasure request
measures again."""

from __future__ import annotations

import pytest
import torch

from rheoplan.train import precision as hp
from rheoplan.train import train as tr


@pytest.fixture(scope="module")
def head_and_embed(tiny_target):
    V = tiny_target.config.vocab_size
    ids = torch.arange(40)
    head = tr.init_head(tr.head_config_for(tiny_target.config, 40), ids).float()
    return head, tiny_target.get_input_embeddings().weight.detach().float(), V


def test_timing_both_precisions_leaves_the_head_as_it_was(head_and_embed):
    head, embed, _ = head_and_embed
    before = {k: v.clone() for k, v in head.state_dict().items()}
    times = hp.step_seconds(head, embed, tr.TrainConfig(), pairs=64, rounds=1)
    assert set(times) == set(hp.PRECISIONS) and all(0 < t < 60 for t in times.values())
    assert all(torch.equal(before[k], v) for k, v in head.state_dict().items())


def test_a_synthetic_batch_has_the_shapes_asked_for(head_and_embed):
    head, _, V = head_and_embed
    b = hp.synthetic_batch(head, V, pairs=65, rows=2)
    assert b.tokens.shape == (65,) and b.feats.shape == (65, head.fc.in_features)
    assert b.seq.tolist().count(0) == 33 and int(b.tokens.max()) < V
    with pytest.raises(ValueError, match="rows"):
        hp.synthetic_batch(head, V, pairs=1, rows=2)
    with pytest.raises(ValueError, match="rounds"):
        hp.step_seconds(head, torch.zeros(V, 32), tr.TrainConfig(), rounds=0)


@pytest.mark.parametrize("times, faster", [({"bf16": 8.8, "fp32": 0.34}, "fp32"),
                                           ({"bf16": 0.2, "fp32": 0.5}, "bf16")])
def test_the_faster_precision_is_chosen_and_cached(head_and_embed, monkeypatch, tmp_path, times, faster):
    head, embed, _ = head_and_embed
    monkeypatch.setenv("RHEOPLAN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("RHEOPLAN_REMEASURE", raising=False)
    calls = []
    monkeypatch.setattr(hp, "step_seconds", lambda *a, **k: calls.append(1) or dict(times))
    first = hp.choose(head, embed, tr.TrainConfig())
    assert first["precision"] == faster and not first["cached"] and first["step_s"] == times
    again = hp.choose(head, embed, tr.TrainConfig())
    assert again["precision"] == faster and again["cached"] and len(calls) == 1
    # another shape of step is another record; a remeasure request measures again
    assert not hp.choose(head, embed, tr.TrainConfig(ttt_steps=3))["cached"] and len(calls) == 2
    monkeypatch.setenv("RHEOPLAN_REMEASURE", "1")
    assert not hp.choose(head, embed, tr.TrainConfig())["cached"] and len(calls) == 3
