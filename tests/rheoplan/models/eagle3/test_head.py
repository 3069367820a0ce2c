"""The head's attention: grouped key/value heads without copying the cache; a block-diagonal
mask as its blocks; its rotary embedding read from a table."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rheoplan.models.eagle3.head import Eagle3Attention, Eagle3Config, Eagle3Head, RowBlocks, _rotate_half


def _repeated_heads(attn: Eagle3Attention, x, cos, sin, past, allowed) -> torch.Tensor:
    """The textbook form: every key/value head copied to each of its query heads."""
    n = x.shape[0]
    q = attn.q_proj(x).view(n, attn.n_heads, attn.head_dim).transpose(0, 1)
    k = attn.k_proj(x).view(n, attn.n_kv, attn.head_dim).transpose(0, 1)
    v = attn.v_proj(x).view(n, attn.n_kv, attn.head_dim).transpose(0, 1)
    q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    k, v = torch.cat([past[0], k], dim=1), torch.cat([past[1], v], dim=1)
    rep = attn.n_heads // attn.n_kv
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, dim=0), v.repeat_interleave(rep, dim=0),
                                         attn_mask=allowed[None])
    return attn.o_proj(out.transpose(0, 1).reshape(n, attn.n_heads * attn.head_dim))


def _packed_rows(lens, steps):
    """Query and key ids and a block-diagonal mask of rows packed as training packs them:
    keys ``[step 1 | ... | step k]``, a random pattern within each row, the diagonal kept."""
    seq = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])
    key_seq = seq.repeat(steps)
    allowed = (seq[:, None] == key_seq[None, :]) & (torch.rand(len(seq), len(key_seq)) < 0.5)
    allowed[torch.arange(len(seq)), torch.arange(len(seq))] = True
    return seq, key_seq, allowed


@pytest.mark.parametrize("kv_heads", [1, 3])
@pytest.mark.parametrize("steps", [1, 2])
def test_row_blocks_give_the_dense_masks_attention_and_gradients(kv_heads, steps):
    torch.manual_seed(kv_heads + 10 * steps)
    cfg = Eagle3Config(vocab_size=50, draft_vocab_size=20, hidden_size=48, intermediate_size=64,
                       num_attention_heads=6, num_key_value_heads=kv_heads)
    attn, hd = Eagle3Attention(cfg), cfg.head_dim
    lens = [4, 1, 6, 3]
    seq, key_seq, allowed = _packed_rows(lens, steps)
    n = len(seq)
    past = None if steps == 1 else (torch.randn(kv_heads, (steps - 1) * n, hd), torch.randn(kv_heads, (steps - 1) * n, hd))
    x = torch.randn(n, 2 * cfg.hidden_size, requires_grad=True)
    ang = torch.rand(n, hd)
    outs, grads = [], []
    for mask in (allowed, RowBlocks.from_dense(allowed, seq, key_seq)):
        out, kv = attn(x, ang.cos(), ang.sin(), past, mask)
        (gx,) = torch.autograd.grad((out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum(), x)
        outs.append(out.detach())
        grads.append(gx)
        assert kv[0].shape == (kv_heads, steps * n, hd)
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads[1], grads[0], atol=1e-5, rtol=1e-5)


def test_row_blocks_refuse_a_mask_that_crosses_rows():
    seq, key_seq, allowed = _packed_rows([3, 2], 1)
    blocks = RowBlocks.from_dense(allowed, seq, key_seq).blocks
    assert [(a, b, c.tolist()) for a, b, c, _ in blocks] == [(0, 3, [0, 1, 2]), (3, 5, [3, 4])]
    allowed[4, 0] = True  # the second row's last pair sees the first row's first
    with pytest.raises(ValueError, match="1 \\(query, key\\) pairs of different ids"):
        RowBlocks.from_dense(allowed, seq, key_seq)
    with pytest.raises(ValueError, match="allowed has shape \\(5, 5\\): allowed \\(5, 4\\)"):
        RowBlocks.from_dense(allowed, seq, key_seq[:4])


@pytest.mark.parametrize("kv_heads", [1, 2, 6])
@pytest.mark.parametrize("n", [1, 5])
def test_grouped_attention_equals_repeated_heads(kv_heads, n):
    torch.manual_seed(kv_heads * 10 + n)
    cfg = Eagle3Config(vocab_size=50, draft_vocab_size=20, hidden_size=48, intermediate_size=64,
                       num_attention_heads=6, num_key_value_heads=kv_heads)
    attn = Eagle3Attention(cfg).eval()
    S, hd = 11, cfg.head_dim
    x = torch.randn(n, 2 * cfg.hidden_size)
    ang = torch.rand(n, hd)
    past = (torch.randn(kv_heads, S, hd), torch.randn(kv_heads, S, hd))
    allowed = torch.rand(n, S + n) < 0.6  # a different mask per query: the row order matters
    allowed[:, 0] = True
    with torch.no_grad():
        got, (k, v) = attn(x, ang.cos(), ang.sin(), past, allowed)
        want = _repeated_heads(attn, x, ang.cos(), ang.sin(), past, allowed)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert k.shape == v.shape == (kv_heads, S + n, hd)  # the cache keeps one entry per key/value head


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
                                     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}])
def test_the_rope_table_gives_the_rotary_modules_cos_and_sin_bit_for_bit(dtype, scaling):
    cfg = Eagle3Config(vocab_size=50, draft_vocab_size=20, hidden_size=48, intermediate_size=64,
                       num_attention_heads=6, num_key_value_heads=2, rope_scaling=scaling,
                       max_position_embeddings=4096)
    head = Eagle3Head(cfg).to(dtype)
    h = torch.zeros(3, cfg.hidden_size, dtype=dtype)
    # the table starts at 256 rows; position 256 needs 512, 700 needs 1024, 2000 needs 2048
    for pos in ([0, 1, 2], [17], [256], [255, 511, 700], [3, 2000, 9], [41, 41, 40]):
        p = torch.tensor(pos)
        got = head.cos_sin(h[:len(pos)], p, max(pos))
        want = head.rotary(h[None, :len(pos)], p[None])
        assert got[0].dtype == dtype
        assert torch.equal(got[0], want[0][0]) and torch.equal(got[1], want[1][0])
    assert head.__dict__["_rope_table"][1].shape[0] == 2048
    del head.__dict__["_rope_table"]
    head.cos_sin(h[:1], torch.tensor([3000]))  # no bound (training, a device step): the module, no table
    assert "_rope_table" not in head.__dict__
    other = head.cos_sin(h.float(), torch.tensor([5]), 5)  # another dtype: a table of its own
    assert other[0].dtype == torch.float32 and torch.equal(other[0], head.rotary(h.float()[None, :1],
                                                                                torch.tensor([[5]]))[0][0])


def _bf16_head(seed: int = 0) -> Eagle3Head:
    """A SmolLM2-sized head (H 576, 9 / 3 heads of 64) in bfloat16 with random weights, norms
    included, so every glue step has something to round."""
    torch.manual_seed(seed)
    cfg = Eagle3Config(vocab_size=300, draft_vocab_size=120, hidden_size=576, intermediate_size=256,
                       num_attention_heads=9, num_key_value_heads=3, target_hidden_size=576)
    head = Eagle3Head(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0.0, 0.05)
        for norm in (head.norm, head.midlayer.input_layernorm, head.midlayer.hidden_norm,
                     head.midlayer.post_attention_layernorm):
            norm.weight.add_(1.0)
    return head


def _head_call(head: Eagle3Head, n: int, cached: int, g: torch.Generator):
    """One call over ``n`` new pairs after ``cached`` entries: (hidden, k, v, draft logits)."""
    cfg, dt = head.config, head.fc.weight.dtype
    embeds = torch.randn(n, cfg.hidden_size, generator=g).to(dt)
    feats = (3 * torch.randn(n, 3 * cfg.target_hidden_size, generator=g)).to(dt)
    past = None if not cached else tuple(torch.randn(cfg.num_key_value_heads, cached, cfg.head_dim,
                                                     generator=g).to(dt) for _ in range(2))
    allowed = torch.ones(n, cached + n, dtype=torch.bool).tril(cached)
    hidden, (k, v) = head(embeds, feats, torch.arange(n) + cached, past, allowed, cached + n)
    return hidden, k, v, head.draft_logits(hidden)


@pytest.mark.parametrize("n, cached", [(1, 0), (3, 40), (16, 7), (17, 5)])
def test_the_fused_glue_gives_the_heads_outputs_bit_for_bit(monkeypatch, n, cached):
    from rheoplan.kernels.decoder_glue import cpu

    calls = []
    for name in ("rms_norm", "add_rms_norm", "rope"):
        real = getattr(cpu, name)
        monkeypatch.setattr(cpu, name, lambda *a, _f=real, _n=name: calls.append(_n) or _f(*a))
    head = _bf16_head()
    with torch.no_grad():
        want = _head_call(head, n, cached, torch.Generator().manual_seed(n))
        assert calls == []  # off until fuse_glue
        head.fuse_glue(True)
        got = _head_call(head, n, cached, torch.Generator().manual_seed(n))
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    if n > 16:  # more rows than decoder_glue.MAX_ROWS: torch's operators
        assert calls == []
    else:  # two rotary embeddings always; the norms where torch's summation order was found here
        assert calls.count("rope") == 2
        if cpu.norm_applies():
            assert sorted(set(calls)) == ["add_rms_norm", "rms_norm", "rope"] and calls.count("rms_norm") == 3


def test_the_fused_glue_steps_aside_for_gradients_float32_subclassed_layers_and_hooks(monkeypatch):
    from rheoplan.kernels.decoder_glue import cpu
    from rheoplan.models.eagle3.head import Eagle3Layer

    calls = []
    monkeypatch.setattr(cpu, "rope", lambda *a: calls.append("rope"))  # would break any call it got
    head = _bf16_head()
    head.fuse_glue(True)
    hidden, _, _, logits = _head_call(head, 2, 3, torch.Generator().manual_seed(1))  # autograd on: training
    assert hidden.requires_grad and logits.requires_grad and calls == []
    with torch.no_grad():
        _head_call(head.float(), 2, 3, torch.Generator().manual_seed(1))
        assert calls == []

        class Stacked(Eagle3Layer):  # a subclass keeps its own forward (examples/measure_head_layers.py)
            pass
        head = _bf16_head()
        head.fuse_glue(True)
        head.midlayer.__class__ = Stacked
        _head_call(head, 2, 3, torch.Generator().manual_seed(1))
        assert calls == []
        head.midlayer.__class__ = Eagle3Layer
        seen = []
        handle = head.midlayer.post_attention_layernorm.register_forward_hook(lambda *a: seen.append(1))
        _head_call(head, 2, 3, torch.Generator().manual_seed(1))  # a hooked module sees its call
        assert calls == [] and seen == [1]
        handle.remove()
