"""The head's attention: grouped key/value heads without copying the cache; its rotary
embedding read from a table."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rheoplan.models.eagle3.head import Eagle3Attention, Eagle3Config, Eagle3Head, _rotate_half


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
