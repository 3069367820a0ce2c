"""Self-distillation data pipeline: shapes, padding invariance, EOS handling, shards, prompts."""

from __future__ import annotations

import os

import torch

from rheoplan.train import selfdistill as sd


def test_rows_have_consistent_shapes(tiny_target, tiny_rows):
    H = tiny_target.config.hidden_size
    for r in tiny_rows:
        m = r["tokens"].numel()
        assert r["prompt_len"] <= m
        assert r["feats"].shape == (m, 3 * H) and r["feats"].dtype == torch.float16
        assert r["topk_ids"].shape == (m, 8) and r["topk_ids"].dtype == torch.int32
        assert r["topk_logp"].shape == (m, 8)
        # top-k log-probs are sorted and are log-probabilities
        lp = r["topk_logp"].float()
        assert (lp[:, :-1] >= lp[:, 1:] - 1e-3).all() and (lp <= 1e-3).all()
        assert float(lp.exp().sum(-1).max()) <= 1.0 + 1e-2


def test_left_padded_batch_matches_single_forward(tiny_target, tiny_rows):
    """Features and targets recorded while sampling a padded batch equal one forward per row."""
    idx = sd.capture_indices(tiny_target)
    for r in tiny_rows[:6]:
        with torch.no_grad():
            out = tiny_target(r["tokens"].long()[None], output_hidden_states=True)
        f = torch.cat([out.hidden_states[i] for i in idx], -1)[0]
        torch.testing.assert_close(r["feats"].float(), f, atol=2e-3, rtol=2e-3)
        lp = torch.log_softmax(out.logits[0], -1)
        torch.testing.assert_close(r["topk_logp"].float(), lp.gather(1, r["topk_ids"].long()), atol=2e-3, rtol=0)
        assert torch.equal(r["topk_ids"][:, 0].long(), lp.argmax(-1))


def test_greedy_rows_follow_the_argmax_and_stop_at_eos(tiny_target):
    rows = sd.sample_with_features(tiny_target, [[1, 2, 3], [4, 5, 6, 7]], max_new_tokens=6, temperature=0,
                                   eos_id=0, topk=4)
    for r in rows:
        P = r["prompt_len"]
        gen = r["tokens"][P:].tolist()
        assert 0 not in gen  # the EOS is the last target, never an input
        # each generated token is the argmax of the previous position's distribution
        assert gen == r["topk_ids"][P - 1:-1, 0].tolist()


def test_eos_truncates_rows():
    """A model that always predicts EOS yields prompt-only rows whose last target is EOS."""
    from transformers import LlamaConfig, LlamaForCausalLM

    m = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                                     num_attention_heads=2, num_key_value_heads=1, vocab_size=20)).eval()
    with torch.no_grad():
        m.lm_head.weight.zero_()  # all logits equal: the argmax is id 0 = EOS
    rows = sd.sample_with_features(m, [[3, 4], [5, 6, 7]], max_new_tokens=5, temperature=0, eos_id=0, topk=3)
    assert [r["tokens"].tolist() for r in rows] == [[3, 4], [5, 6, 7]]


class _FakeTokenizer:
    eos_token_id = 0

    def apply_chat_template(self, msgs, tokenize, add_generation_prompt):
        return [1, 2] + [3 + (ord(c) % 40) for c in msgs[0]["content"]][:6] + [2]


def test_shards_round_trip_and_resume(tiny_target, tmp_path, monkeypatch):
    prompts = ["hello", "code please", "two plus two", "summarise this", "hi"]
    paths = sd.generate_shards(tiny_target, _FakeTokenizer(), prompts, str(tmp_path), split="train",
                               temperatures=[0, 1.0], max_new_tokens=4, batch_size=2, topk=4, progress=False)
    # cycle mode: 3 prompts at T=0 (2 batches), 2 at T=1 (1 batch)
    assert [os.path.basename(p) for p in paths] == ["train_T0_0000.pt", "train_T0_0001.pt", "train_T1_0000.pt"]
    rows = sd.load_shards(paths)
    assert len(rows) == len(prompts)
    assert sorted(r["temperature"] for r in rows) == [0, 0, 0, 1, 1]
    # resuming skips finished shards: sampling is not called again
    calls = []
    monkeypatch.setattr(sd, "sample_with_features", lambda *a, **k: calls.append(1))
    again = sd.generate_shards(tiny_target, _FakeTokenizer(), prompts, str(tmp_path), split="train",
                               temperatures=[0, 1.0], max_new_tokens=4, batch_size=2, topk=4, progress=False)
    assert again == paths and not calls


def test_shipped_prompt_files():
    train = sd.read_prompts(sd.data_file("prompts_train.txt"))
    held = sd.read_prompts(sd.data_file("prompts_heldout.txt"))
    assert len(train) >= 300 and len(held) >= 40
    assert not {p for _, p in train} & {p for _, p in held}
    assert len({p for _, p in train}) == len(train)
    assert {c for c, _ in held} == {"chat", "code", "math", "summarisation"}
    assert {"chat", "code", "math", "summarisation", "instructions"} <= {c for c, _ in train}


def test_read_prompts_rejects_lines_without_a_category(tmp_path):
    import pytest

    f = tmp_path / "p.txt"
    f.write_text("# comment\nchat\tfine\nno tab here\n")
    with pytest.raises(ValueError, match="category<TAB>prompt"):
        sd.read_prompts(f)
