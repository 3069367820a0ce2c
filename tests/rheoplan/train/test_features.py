"""Teacher-forced features and soft targets: a padded batch equals one forward per row."""

from __future__ import annotations

import copy

import pytest
import torch

from rheoplan.train import features as ft
from rheoplan.train import train as tr


def _rows():
    return [{"tokens": torch.tensor(t), "prompt_len": p} for t, p in
            [([1, 5, 6, 7, 9, 9, 3], 4), ([1, 2], 1), ([1, 8, 8, 4, 40, 41, 42, 43, 44, 45], 3)]]


def test_padded_batch_matches_single_row_forwards(tiny_target):
    idx = ft.capture_indices(tiny_target)
    got = ft.teacher_forced(tiny_target, _rows(), topk=8)
    for r in got:
        with torch.no_grad():
            out = tiny_target(r["tokens"][None], output_hidden_states=True)
        f = torch.cat([out.hidden_states[i] for i in idx], -1)[0]
        torch.testing.assert_close(r["feats"], f, atol=1e-5, rtol=1e-5)
        lp = torch.log_softmax(out.logits[0].float(), -1)
        torch.testing.assert_close(r["topk_logp"], lp.topk(8, -1).values, atol=1e-5, rtol=1e-5)
        assert torch.equal(r["topk_ids"][:, 0], lp.argmax(-1))
        assert r["feats"].shape == (r["tokens"].numel(), 3 * tiny_target.config.hidden_size)


@pytest.mark.parametrize("block", [1, 3, 16, 100])
def test_top_log_probs_in_blocks_equal_the_whole_tensor_way(block):
    logits = (torch.randn(2, 7, 50, generator=torch.Generator().manual_seed(0)) * 4).to(torch.bfloat16)
    lp, ids = ft.top_log_probs(logits, 5, block=block)
    want = torch.log_softmax(logits.float(), -1).topk(5, -1)
    assert lp.shape == ids.shape == (2, 7, 5) and lp.dtype == torch.float32
    torch.testing.assert_close(lp, want.values)
    assert torch.equal(ids, want.indices)


def test_top_log_probs_rejects_an_empty_block():
    with pytest.raises(ValueError, match="block=0"):
        ft.top_log_probs(torch.zeros(1, 2, 4), 2, block=0)


def test_row_examples_make_the_same_examples_as_in_memory_rows(tiny_target):
    rows = _rows()
    src = ft.RowExamples(tiny_target, rows, topk=8, shared_prefix=1, prompt_weight=0.3, batch_tokens=12)
    assert src.lengths() == [6, 1, 9] and len(src) == 3
    want = [tr.make_example(r, shared_prefix=1, prompt_weight=0.3)
            for r in ft.teacher_forced(tiny_target, rows, topk=8)]
    got = src.get([2, 0, 1])  # any order, split over several forwards (batch_tokens=12)
    for g, w in zip(got, [want[2], want[0], want[1]]):
        assert torch.equal(g.tokens, w.tokens) and torch.equal(g.weight, w.weight)
        torch.testing.assert_close(g.feats, w.feats, atol=1e-5, rtol=1e-5)
        assert torch.equal(g.topk_ids, w.topk_ids)


def test_cached_row_examples_forward_each_row_once(tiny_target, monkeypatch):
    src = ft.RowExamples(tiny_target, _rows(), topk=4, shared_prefix=1, prompt_weight=0.3, cache=True)
    first = src.get([0, 1, 2])
    calls = []
    monkeypatch.setattr(ft, "teacher_forced", lambda *a, **k: calls.append(1))
    again = src.get([0, 1, 2])
    assert not calls and all(a is b for a, b in zip(first, again))


def test_bad_topk_is_rejected(tiny_target):
    with pytest.raises(ValueError, match="topk"):
        ft.teacher_forced(tiny_target, _rows(), topk=0)


def test_cache_budget_keeps_rows_until_full_and_remakes_the_rest(tiny_target, monkeypatch):
    rows = _rows()
    probe = ft.RowExamples(tiny_target, rows, topk=4, shared_prefix=1, prompt_weight=0.3)
    fresh = probe.get([0, 1, 2])
    # room for rows 0 and 1 (6 + 1 pairs) but not for row 2 (9 pairs) as well
    gb = 7.5 * probe.pair_bytes() / 2**30
    src = ft.RowExamples(tiny_target, rows, topk=4, shared_prefix=1, prompt_weight=0.3, cache_gb=gb)
    src.get([0, 1, 2])
    assert src.cached_rows() == 2
    made = []
    real = ft.teacher_forced
    monkeypatch.setattr(ft, "teacher_forced", lambda m, rs, **k: made.append(len(rs)) or real(m, rs, **k))
    again = src.get([2, 0, 1])
    assert made == [1]  # only the row that did not fit runs again
    for g, w in zip(again, [fresh[2], fresh[0], fresh[1]]):
        assert torch.equal(g.tokens, w.tokens) and torch.equal(g.topk_ids, w.topk_ids)
        torch.testing.assert_close(g.feats.float(), w.feats, atol=1e-5, rtol=1e-5)


def test_made_again_share_follows_the_caches(tiny_target, tmp_path):
    rows, kw = _rows(), dict(topk=4, shared_prefix=1, prompt_weight=0.3)
    probe = ft.RowExamples(tiny_target, rows, **kw)
    assert probe.features_bytes() == sum(probe.lengths()) * probe.pair_bytes() > 0
    assert probe.made_again_share() == 1.0  # no cache: a later epoch makes every row again
    assert ft.RowExamples(tiny_target, rows, cache=True, **kw).made_again_share() == 0.0
    assert ft.RowExamples(tiny_target, rows, cache_dir=tmp_path, **kw).made_again_share() == 0.0
    quarter = probe.features_bytes() / 4 / 2**30
    assert ft.RowExamples(tiny_target, rows, cache_gb=quarter, **kw).made_again_share() == pytest.approx(0.75)
    assert ft.RowExamples(tiny_target, rows, cache_gb=1.0, **kw).made_again_share() == 0.0
    # a budget on disk-backed rows: every row is read back from its file all the same
    assert ft.RowExamples(tiny_target, rows, cache_gb=quarter, cache_dir=tmp_path, **kw).made_again_share() == 0.0


def test_cached_features_are_stored_in_the_target_dtype_without_loss(tiny_target):
    model = copy.deepcopy(tiny_target).to(torch.bfloat16)  # a copy: the fixture is shared by the module
    src = ft.RowExamples(model, _rows(), topk=4, shared_prefix=1, prompt_weight=0.3, cache_gb=1.0)
    fresh = ft.RowExamples(model, _rows(), topk=4, shared_prefix=1, prompt_weight=0.3).get([0, 1, 2])
    got = src.get([0, 1, 2])
    assert all(g.feats.dtype == torch.bfloat16 for g in got)
    # the features are the model's bf16 hidden states: nothing lost by storing them in bf16
    assert all(torch.equal(g.feats.float(), w.feats) for g, w in zip(got, fresh))
    assert src.pair_bytes() == 3 * model.config.hidden_size * 2 + 4 * 12 + 13


def test_bad_cache_budget_is_rejected(tiny_target):
    with pytest.raises(ValueError, match="cache_gb"):
        ft.RowExamples(tiny_target, _rows(), topk=4, shared_prefix=1, prompt_weight=0.3, cache_gb=-1)


def test_cache_dir_makes_each_row_once_across_sources_and_reads_the_same_examples(tiny_target, tmp_path,
                                                                                  monkeypatch):
    rows = _rows()
    fresh = ft.RowExamples(tiny_target, rows, topk=4, shared_prefix=1, prompt_weight=0.3).get([0, 1, 2])
    first = ft.RowExamples(tiny_target, rows, topk=4, shared_prefix=1, prompt_weight=0.3, cache_dir=tmp_path)
    first.get([0, 1, 2])
    assert first.disk_hits == 0 and len(list(tmp_path.rglob("*.pt"))) == 3
    assert not list(tmp_path.rglob("*.tmp"))
    # a new source (a resumed sitting, a new run) over the same rows and target: no forward
    monkeypatch.setattr(ft, "teacher_forced", lambda *a, **k: pytest.fail("a row was made again"))
    again = ft.RowExamples(tiny_target, rows, topk=4, shared_prefix=1, prompt_weight=0.7, cache_dir=tmp_path)
    got = again.get([2, 0, 1])
    assert again.disk_hits == 3
    for g, w in zip(got, [fresh[2], fresh[0], fresh[1]]):
        assert torch.equal(g.tokens, w.tokens) and torch.equal(g.topk_ids, w.topk_ids)
        assert torch.equal(g.feats.float(), w.feats) and torch.equal(g.topk_logp, w.topk_logp)
    # the weights follow the new source's prompt_weight (only the target's outputs are stored)
    assert float(got[1].weight[0]) == pytest.approx(0.7) and float(fresh[0].weight[0]) == pytest.approx(0.3)


def test_cache_dir_files_belong_to_one_target_and_topk(tiny_target, tmp_path):
    rows = _rows()
    ft.RowExamples(tiny_target, rows, topk=4, shared_prefix=1, prompt_weight=0.3, cache_dir=tmp_path).get([0])
    other_k = ft.RowExamples(tiny_target, rows, topk=3, shared_prefix=1, prompt_weight=0.3, cache_dir=tmp_path)
    other_k.get([0])
    changed = copy.deepcopy(tiny_target)
    with torch.no_grad():
        next(changed.parameters()).add_(0.01)
    other_m = ft.RowExamples(changed, rows, topk=4, shared_prefix=1, prompt_weight=0.3, cache_dir=tmp_path)
    got = other_m.get([0])
    assert other_k.disk_hits == 0 and other_m.disk_hits == 0
    assert ft.model_digest(changed) != ft.model_digest(tiny_target)
    assert len(list(tmp_path.rglob("*.pt"))) == 3
    assert got[0].topk_ids.shape[-1] == 4


def test_forward_groups_keep_padding_and_size_within_bounds():
    """Every row in exactly one forward; a forward of several rows within ``batch_tokens``
    padded positions and its padding within the share; rows of equal length batch, rows of
    other lengths do not (the 32% of padding that filled forwards carried)."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 700, (300,), generator=g).tolist() + [256] * 8 + [5000]
    groups = ft.forward_groups(lengths, batch_tokens=2048)
    assert sorted(i for b in groups for i in b) == list(range(len(lengths)))
    for b in groups:
        longest, real = max(lengths[i] for i in b), sum(lengths[i] for i in b)
        assert len(b) == 1 or (longest * len(b) <= 2048 and longest * len(b) - real <= ft.PAD_SHARE * longest * len(b))
    assert [b for b in groups if lengths[b[0]] == 256 and len(b) > 1]  # equal lengths share forwards
    padded = sum(max(lengths[i] for i in b) * len(b) for b in groups)
    assert padded - sum(lengths) <= ft.PAD_SHARE * padded
    assert ft.forward_groups([], batch_tokens=8) == []
    with pytest.raises(ValueError, match="pad_share"):
        ft.forward_groups([3], batch_tokens=8, pad_share=1.0)
