"""Draft vocabulary, head construction, training-time test, loss, resume, export."""

from __future__ import annotations

import pytest
import torch

from rheoplan.models.eagle3 import load_eagle3_checkpoint, read_eagle3, save_eagle3
from rheoplan.train import train as tr

V_DRAFT = 32


@pytest.fixture(scope="module")
def setup(tiny_target, tiny_rows):
    V = tiny_target.config.vocab_size
    ids = tr.choose_draft_vocab(tr.token_counts(tiny_rows, V), V_DRAFT, always=[0])
    shared = tr.common_prefix_len(tiny_rows)
    ex = [tr.make_example(r, shared_prefix=shared, prompt_weight=0.3) for r in tiny_rows]
    embed = tiny_target.get_input_embeddings().weight.detach()
    cfg = tr.head_config_for(tiny_target.config, V_DRAFT)
    return {"ids": ids, "ex": ex, "embed": embed, "cfg": cfg, "scale": tr.feature_scale(tiny_rows),
            "t2d": tr.target_to_draft_index(ids, V)}


def test_draft_vocab_is_the_most_probable_tokens():
    mass = torch.tensor([0.0, 9.0, 1.0, 5.0, 5.0, 7.0])
    assert tr.choose_draft_vocab(mass, 3).tolist() == [1, 3, 5]  # tie 3/4: lower id first
    assert tr.choose_draft_vocab(mass, 3, always=[0]).tolist() == [0, 1, 5]
    with pytest.raises(ValueError, match="draft vocab size"):
        tr.choose_draft_vocab(mass, 7)


def test_token_counts_skip_the_shared_prefix():
    rows = [{"tokens": torch.tensor([7, 7, 1, 2, 2])}, {"tokens": torch.tensor([7, 7, 2])}]
    assert tr.token_counts(rows, 8, skip_prefix=2).tolist() == [0, 1, 3, 0, 0, 0, 0, 0]


def test_pack_groups_by_length_and_skips_empty_rows():
    assert tr.pack([3, 3, 5, 0, 2], 6) == [[0, 1], [2], [4]]
    chunks = tr.pack([1] * 10, 4, seed=1)
    assert sorted(i for c in chunks for i in c) == list(range(10)) and all(len(c) <= 4 for c in chunks)


def test_vocab_map_matches_the_checkpoint_convention(setup, tmp_path):
    """d2t/t2d written by training are what the loader reads: draft i -> target i + d2t[i]."""
    ids, cfg = setup["ids"], setup["cfg"]
    head = tr.init_head(cfg, ids)
    assert torch.equal(head.target_ids(), ids)
    assert torch.equal(torch.arange(V_DRAFT) + head.d2t, ids)
    assert torch.equal(head.t2d, setup["t2d"] >= 0)
    assert torch.equal(setup["t2d"][ids], torch.arange(V_DRAFT))
    save_eagle3(head, tmp_path)
    back = read_eagle3(tmp_path)
    assert torch.equal(back.target_ids(), ids) and torch.equal(back.t2d, head.t2d)


def test_extend_vocab_keeps_the_head_and_maps_the_new_rows(tiny_target):
    """A grown vocabulary: the next tokens by mass are added, every trained weight and row is
    kept (the old tokens' logits are unchanged), and the new rows are the target's carried by
    the map the old rows were trained along (here an exact affine map, which it recovers)."""
    V, H = tiny_target.config.vocab_size, tiny_target.config.hidden_size
    n = 2 * H  # more rows than the map's H + 1 unknowns per output: the fit is determined
    ids = torch.randperm(V - 10, generator=torch.Generator().manual_seed(1))[:n].sort().values
    head = tr.init_head(tr.head_config_for(tiny_target.config, n), ids, tiny_target)
    out_w = tiny_target.get_output_embeddings().weight.detach().float()
    g = torch.Generator().manual_seed(0)
    M, b = torch.eye(H) + 0.3 * torch.randn(H, H, generator=g), torch.randn(H, generator=g)
    with torch.no_grad():  # "trained" rows: an affine image of the target's, as training drifts them
        head.lm_head.weight.copy_(out_w[ids] @ M + b)
        head.midlayer.mlp.down_proj.weight.mul_(1.5)
    mass = torch.arange(V, dtype=torch.float64)  # the largest ids are the most frequent
    grown = tr.extend_vocab(head, tiny_target, mass, n + 5)
    new_ids = grown.target_ids()
    extra = sorted(set(range(V)) - set(ids.tolist()))[-5:]
    assert new_ids.tolist() == sorted(ids.tolist() + extra)
    old_pos = torch.searchsorted(new_ids, ids)
    new_pos = torch.searchsorted(new_ids, torch.tensor(extra))
    assert torch.equal(grown.lm_head.weight[old_pos], head.lm_head.weight)
    torch.testing.assert_close(grown.lm_head.weight[new_pos], out_w[extra] @ M + b, atol=1e-4, rtol=1e-4)
    assert torch.equal(grown.midlayer.mlp.down_proj.weight, head.midlayer.mlp.down_proj.weight)
    h = torch.randn(3, H, generator=g)
    assert torch.equal(grown.draft_logits(h)[:, old_pos], head.draft_logits(h))
    with pytest.raises(ValueError, match=rf"size={n} is out of range: allowed {n + 1}\.\."):
        tr.extend_vocab(head, tiny_target, mass, n)
    with pytest.raises(ValueError, match="mass has shape"):
        tr.extend_vocab(head, tiny_target, mass[:-1], n + 5)


def test_example_pairs_features_with_the_next_token(tiny_rows):
    r = tiny_rows[0]
    e = tr.make_example(r, shared_prefix=2, prompt_weight=0.5)
    m = r["tokens"].numel()
    assert e.tokens.tolist() == r["tokens"][1:].tolist()
    assert torch.equal(e.feats, r["feats"][:-1])  # pair j = (f_{j-1}, x_j)
    assert torch.equal(e.topk_ids, r["topk_ids"][1:].long())  # label p_j
    P = r["prompt_len"]
    j = torch.arange(1, m)
    assert torch.equal(e.response, j >= P - 1)
    assert e.weight[:1].tolist() == [0.0] and set(e.weight.tolist()) <= {0.0, 0.5, 1.0}


def test_ttt_mask_blocks():
    seq = torch.tensor([0, 0, 0, 1, 1])
    local = torch.tensor([0, 1, 2, 0, 1])
    m1 = tr.ttt_mask(seq, local, 1)
    assert m1.int().tolist()[2] == [1, 1, 1, 0, 0] and m1.int().tolist()[4] == [0, 0, 0, 1, 1]
    m3 = tr.ttt_mask(seq, local, 3)
    # pair 2 of row 0 at step 3: step-1 key 0, step-2 key 1, step-3 key 2
    assert m3[2].nonzero().flatten().tolist() == [0, 5 + 1, 10 + 2]
    assert m3.any(1).all()  # no empty row (attention stays finite)


def test_step2_uses_the_heads_own_hidden(setup):
    """Changing features only at pair i changes step-2 outputs at i+1 through the own hidden."""
    head = tr.init_head(setup["cfg"], setup["ids"]).eval()
    b = tr.collate(setup["ex"][:1])
    outs = tr.ttt_forward(head, setup["embed"], b, 2)
    b2 = tr.collate(setup["ex"][:1])
    b2.feats[3] += 5.0
    outs2 = tr.ttt_forward(head, setup["embed"], b2, 2)
    # step 1 at pair 4 sees pair 3's feature only through attention; step 2 at pair 4 takes
    # step-1's output at pair 3 as its hidden, and step 2 at pair 3 sees only pairs <= 2 and itself.
    assert torch.allclose(outs[0][:3], outs2[0][:3]) and torch.allclose(outs[1][:4], outs2[1][:4])
    assert not torch.allclose(outs[1][4], outs2[1][4])


def test_a_few_steps_reduce_the_loss(setup):
    head = tr.init_head(setup["cfg"], setup["ids"])
    args = dict(steps=2, chunk_tokens=128, draft_ids=setup["ids"], t2d_index=setup["t2d"], scale=setup["scale"])
    before = tr.evaluate(head, setup["embed"], setup["ex"], **args)
    cfg = tr.TrainConfig(epochs=6, lr=3e-3, chunk_tokens=128, autocast_bf16=False, warmup_frac=0.1)
    out = tr.train_head(head, setup["embed"], setup["ex"], cfg, progress=False, scale=setup["scale"])
    after = tr.evaluate(head, setup["embed"], setup["ex"], **args)
    assert after["loss_step1"] < before["loss_step1"] - 0.2
    assert out["last"]["loss"] < out["history"][0]["loss"]
    assert 0 <= after["accept_lo_step1"] <= after["accept_hi_step1"] <= 1 + 1e-6


def test_progress_lines_give_the_epochs_end_and_the_runs(setup, capsys):
    cfg = tr.TrainConfig(epochs=2, lr=3e-3, chunk_tokens=96, autocast_bf16=False, log_every=1)
    head = tr.init_head(setup["cfg"], setup["ids"])
    out = tr.train_head(head, setup["embed"], setup["ex"], cfg, progress=False, scale=setup["scale"])
    hist, lines = out["history"], capsys.readouterr().out.splitlines()
    first_epoch = sum(r["epoch"] == 0 for r in hist)  # (each epoch packs its chunks anew)
    assert 2 <= first_epoch < len(hist) == len(lines)
    last0 = hist[first_epoch - 1]  # an epoch's last step: it ends now, the run has the other epoch to go
    assert last0["epoch_eta_s"] == 0 and last0["eta_s"] > 0
    first = hist[0]  # both at the same rate: steps left in the epoch against steps left in the run
    assert first["epoch_eta_s"] == pytest.approx(first["eta_s"] * (first_epoch - 1) / (len(hist) - 1))
    assert "this epoch ends in 0.00 h, the run in" in lines[first_epoch - 1]


def test_run_eta_prices_later_epochs_at_the_head_steps_pace_after_a_making_first_epoch():
    # 10 steps done of 30, the first epoch ends at 12: 2 steps at 0.5 / s, then 18 later steps
    kw = dict(first_epoch=True, head_steps_per_s=2.0)
    assert tr.run_eta_s(10, 30, 12, 0.5, made_again=0.0, **kw) == pytest.approx(2 / 0.5 + 18 / 2.0)
    assert tr.run_eta_s(10, 30, 12, 0.5, made_again=1.0, **kw) == pytest.approx(20 / 0.5)
    assert tr.run_eta_s(10, 30, 12, 0.5, made_again=0.25, **kw) == pytest.approx(4 + 18 * (0.25 / 0.5 + 0.75 / 2))
    # one pace throughout: a later epoch, a source that makes nothing, no head pace yet
    for other in (dict(first_epoch=False, made_again=0.0, head_steps_per_s=2.0),
                  dict(first_epoch=True, made_again=None, head_steps_per_s=2.0),
                  dict(first_epoch=True, made_again=0.0, head_steps_per_s=None)):
        assert tr.run_eta_s(10, 30, 12, 0.5, **other) == pytest.approx(20 / 0.5)
    assert tr.run_eta_s(30, 30, 30, 0.5, made_again=0.0, **kw) == 0.0
    with pytest.raises(ValueError, match="steps_per_s"):
        tr.run_eta_s(1, 2, 2, 0.0)
    with pytest.raises(ValueError, match="made_again"):
        tr.run_eta_s(1, 2, 2, 1.0, made_again=1.5, **kw)


class _MadeFirst(tr.ExampleList):
    """In-memory examples that claim to be made in the first epoch and read back later."""

    def made_again_share(self) -> float:
        return 0.0


def test_progress_lines_price_later_epochs_at_the_head_steps_pace(setup, capsys):
    cfg = tr.TrainConfig(epochs=3, lr=3e-3, chunk_tokens=96, autocast_bf16=False, log_every=1)
    head = tr.init_head(setup["cfg"], setup["ids"])
    out = tr.train_head(head, setup["embed"], _MadeFirst(setup["ex"]), cfg, progress=False, scale=setup["scale"])
    hist, lines = out["history"], capsys.readouterr().out.splitlines()
    first_epoch = sum(r["epoch"] == 0 for r in hist)
    for r in hist[:first_epoch]:
        assert r["eta_s"] == pytest.approx(tr.run_eta_s(r["step"], len(hist), first_epoch, r["steps_per_s"],
                                                        first_epoch=True, made_again=0.0,
                                                        head_steps_per_s=r["head_steps_per_s"]))
        assert r["head_steps_per_s"] >= r["steps_per_s"] * 0.999  # the head's steps are part of a step
    for r in hist[first_epoch:]:
        assert r["eta_s"] == pytest.approx((len(hist) - r["step"]) / r["steps_per_s"])
    assert all("100% at the head steps' pace" in line for line in lines[:first_epoch])
    assert all(line.endswith("at this rate") for line in lines[first_epoch:])


def test_tv_term_is_the_mass_the_acceptance_proxy_misses():
    # two positions over a 4-token draft vocabulary; p known on its top-3, one of them out of vocab
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0]], requires_grad=True)
    d = torch.tensor([[0, 1, 0], [3, 2, 1]])
    p = torch.tensor([[0.5, 0.3, 0.0], [0.4, 0.2, 0.1]])  # row 0: the third entry is out of vocab
    mass, w = p.sum(-1), torch.ones(2)
    ce = tr.step_loss(logits, d, p, mass, w)
    both = tr.step_loss(logits, d, p, mass, w, tv_weight=2.0)
    q = torch.softmax(logits.detach(), -1)
    overlap = torch.minimum(p, q.gather(1, d) * (p > 0)).sum(-1)  # step_metrics' accept_lo
    assert torch.allclose(both - ce, 2.0 * (mass - overlap).mean())
    assert torch.equal(tr.step_loss(logits, d, p, mass, w, tv_weight=0.0), ce)
    # its gradient raises q where q < p: the logit of token 3 in row 1 (q 0.25 < p 0.4)
    g, = torch.autograd.grad(both - ce, logits)
    assert g[1, 3] < 0


def test_training_from_token_rows_equals_training_on_in_memory_examples(tiny_target, tiny_rows, setup):
    """The on-demand source (target forwards per chunk, nothing stored) trains exactly like
    examples whose features were computed up front."""
    from rheoplan.train.features import RowExamples

    tok_rows = [{"tokens": r["tokens"], "prompt_len": r["prompt_len"]} for r in tiny_rows]
    shared = tr.common_prefix_len(tiny_rows)
    src = RowExamples(tiny_target, tok_rows, topk=8, shared_prefix=shared, prompt_weight=0.3, batch_tokens=64)
    cfg = tr.TrainConfig(epochs=1, lr=3e-3, chunk_tokens=96, autocast_bf16=False)
    a = tr.init_head(setup["cfg"], setup["ids"], seed=4)
    b = tr.init_head(setup["cfg"], setup["ids"], seed=4)
    ra = tr.train_head(a, setup["embed"], setup["ex"], cfg, progress=False, max_steps=3, scale=setup["scale"])
    rb = tr.train_head(b, setup["embed"], src, cfg, progress=False, max_steps=3, scale=setup["scale"])
    assert [h["loss"] for h in rb["history"]] == pytest.approx([h["loss"] for h in ra["history"]], rel=1e-4)
    ev = dict(steps=3, chunk_tokens=128, draft_ids=setup["ids"], t2d_index=setup["t2d"], scale=setup["scale"])
    ea, eb = tr.evaluate(a, setup["embed"], setup["ex"], **ev), tr.evaluate(b, setup["embed"], src, **ev)
    assert eb == pytest.approx(ea, rel=1e-4)
    assert 0 <= ea["top1_step1"] <= ea["top3_step1"] <= 1 and "top3_step3" in ea


def test_resume_continues_where_the_checkpoint_left(setup, tmp_path):
    cfg = tr.TrainConfig(epochs=2, lr=3e-3, chunk_tokens=96, autocast_bf16=False, ckpt_every=2)
    full = tr.init_head(setup["cfg"], setup["ids"], seed=1)
    r_full = tr.train_head(full, setup["embed"], setup["ex"], cfg, progress=False, max_steps=6, scale=setup["scale"])
    ck = str(tmp_path / "ckpt.pt")
    part = tr.init_head(setup["cfg"], setup["ids"], seed=1)
    tr.train_head(part, setup["embed"], setup["ex"], cfg, ckpt_path=ck, progress=False, max_steps=4,
                  scale=setup["scale"])
    first = torch.load(ck, weights_only=False)["extra"]["wall_s_total"]  # the first sitting's time
    resumed = tr.init_head(setup["cfg"], setup["ids"], seed=2)  # other init: everything comes from the ckpt
    r_res = tr.train_head(resumed, setup["embed"], setup["ex"], cfg, ckpt_path=ck, resume=True, progress=False,
                          max_steps=6, scale=setup["scale"])
    assert r_res["started_at_step"] == 4 and r_res["steps_done"] == 6
    # the wall time adds up over the sittings (the first one's came from the checkpoint)
    assert first > 0 and r_res["wall_s"] > 0
    assert r_res["wall_s_total"] == pytest.approx(first + r_res["wall_s"], abs=0.05)
    assert r_res["last"]["loss"] == pytest.approx(r_full["last"]["loss"], rel=1e-4)
    for (k, a), b in zip(full.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=k)


def test_folded_export_loads_and_matches(setup, tmp_path):
    """Export folds the feature scale into fc; the loaded head on raw features matches."""
    head = tr.init_head(setup["cfg"], setup["ids"], seed=3).eval()
    b = tr.collate(setup["ex"][:2], setup["scale"])
    want = head.draft_logits(tr.ttt_forward(head, setup["embed"], b, 2)[1])
    tr.fold_feature_scale(head, setup["scale"])
    save_eagle3(head, tmp_path)
    back = read_eagle3(tmp_path)
    got = back.draft_logits(tr.ttt_forward(back, setup["embed"], tr.collate(setup["ex"][:2]), 2)[1])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    draft = load_eagle3_checkpoint(tmp_path, setup["embed"])
    assert draft.vocab_size == setup["cfg"].vocab_size


def test_head_config_matches_the_target(tiny_target):
    cfg = tr.head_config_for(tiny_target.config, 16)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        32, 64, 4, 2)
    assert cfg.draft_vocab_size == 16 and cfg.rope_scaling is None
