"""EAGLE-3 head: checkpoint round trip, strict keys, shapes, tree vs chain consistency.

Tolerance 1e-4: fp32, batched tree attention vs one-token-at-a-time chain.
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from _adapter_trees import depths_of, make_draft_tree, make_linear, path_of, random_tree
from rheoplan.models.base import DraftModel
from rheoplan.models.eagle3 import (
    Eagle3Config, Eagle3Draft, Eagle3Head, Eagle3LoadError, load_eagle3_checkpoint, read_eagle3, save_eagle3,
)
from rheoplan.models.hf_target import HFTarget

ATOL = 1e-4
V, H = 101, 64


def make_head(seed: int = 0, draft_vocab: int = 60, target_hidden: int | None = None) -> Eagle3Head:
    cfg = Eagle3Config(vocab_size=V, draft_vocab_size=draft_vocab, hidden_size=H,
                       target_hidden_size=target_hidden, intermediate_size=128,
                       num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(seed)
    head = Eagle3Head(cfg)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.2)
        if draft_vocab != V:
            head.set_vocab_map(torch.randperm(V)[:draft_vocab].sort().values)
    return head.eval()


REFERENCE_KEYS = {
    "fc.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
    "midlayer.post_attention_layernorm.weight", "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "norm.weight", "lm_head.weight",
}


def test_state_dict_keys_and_shapes():
    head = make_head(target_hidden=48)
    sd = head.state_dict()
    assert set(sd) == REFERENCE_KEYS | {"d2t", "t2d"}
    assert sd["fc.weight"].shape == (H, 3 * 48)
    assert sd["midlayer.self_attn.q_proj.weight"].shape == (H, 2 * H)
    assert sd["midlayer.self_attn.k_proj.weight"].shape == (2 * 16, 2 * H)
    assert sd["lm_head.weight"].shape == (60, H)
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool and int(sd["t2d"].sum()) == 60
    assert set(make_head(draft_vocab=V).state_dict()) == REFERENCE_KEYS


def test_target_logits_map_through_d2t():
    head = make_head()
    h = torch.randn(3, H)
    out = head.target_logits(h)
    assert out.shape == (3, V)
    ids = head.target_ids()
    assert torch.equal(out[:, ids], head.draft_logits(h))
    assert torch.equal(torch.isfinite(out[0]), head.t2d)


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_save_load_round_trip(tmp_path, fmt):
    head = make_head(seed=1)
    save_eagle3(head, tmp_path)
    if fmt == "bin":
        from safetensors.torch import load_file
        torch.save(load_file(tmp_path / "model.safetensors"), tmp_path / "pytorch_model.bin")
        os.remove(tmp_path / "model.safetensors")
    back = read_eagle3(tmp_path)
    assert back.config.to_dict() == head.config.to_dict()
    for k, v in head.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    x = torch.randn(2, 3 * H)
    e = torch.randn(2, H)
    allowed = torch.ones(2, 2, dtype=torch.bool).tril()
    a, _ = head(e, x, torch.arange(2), None, allowed)
    b, _ = back(e, x, torch.arange(2), None, allowed)
    assert torch.equal(a, b)


def _rewrite(tmp_path, change):
    from safetensors.torch import load_file, save_file
    sd = load_file(tmp_path / "model.safetensors")
    change(sd)
    save_file(sd, tmp_path / "model.safetensors")


def test_strict_key_errors(tmp_path):
    save_eagle3(make_head(), tmp_path)
    _rewrite(tmp_path, lambda sd: (sd.pop("norm.weight"), sd.pop("lm_head.weight"),
                                   sd.__setitem__("midlayer.extra.weight", torch.zeros(V, H))))
    with pytest.raises(Eagle3LoadError) as err:
        read_eagle3(tmp_path)
    msg = str(err.value)
    assert "missing keys ['lm_head.weight', 'norm.weight']" in msg and "unexpected keys ['midlayer.extra.weight']" in msg


def test_shape_and_file_errors(tmp_path):
    save_eagle3(make_head(), tmp_path)
    _rewrite(tmp_path, lambda sd: sd.__setitem__("lm_head.weight", torch.zeros(7, H)))
    with pytest.raises(Eagle3LoadError, match=r"lm_head.weight: checkpoint \(7, 64\)"):
        read_eagle3(tmp_path)
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(Eagle3LoadError, match="neither"):
        read_eagle3(tmp_path)
    with pytest.raises(Eagle3LoadError, match="config.json"):
        read_eagle3(tmp_path / "nowhere")
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Eagle3LoadError, match="hidden_size"):
        read_eagle3(tmp_path)


# ---------------------------------------------------------------------------------------
# The adapter: tree attention vs a one-pair-at-a-time chain
# ---------------------------------------------------------------------------------------

def chain_logits(head, embed, pairs, path_tokens):
    """Reference: run committed ``(feature, token, position)`` pairs one at a time, then
    the drafted path tokens, each fed the previous output hidden; logits at the end."""
    kv, h = None, None
    for f, t, pos in pairs:
        h, kv = head(embed[[t]], f[None], torch.tensor([pos]), kv,
                     torch.ones(1, 1 + (0 if kv is None else kv[0].shape[1]), dtype=torch.bool))
        last = pos
    for t in path_tokens:
        last += 1
        h, kv = head(embed[[t]], h, torch.tensor([last]), kv,
                     torch.ones(1, 1 + kv[0].shape[1], dtype=torch.bool))
    return head.target_logits(h)[0]


@pytest.mark.parametrize("prompt_len", [1, 5])
def test_tree_logits_equal_chain(prompt_len):
    rng = random.Random(prompt_len)
    head = make_head(seed=2)
    embed = torch.randn(V, H)
    draft = Eagle3Draft(head, embed)
    assert isinstance(draft, DraftModel)
    seq = [rng.randrange(V) for _ in range(prompt_len)]
    feats = torch.randn(prompt_len - 1, 3 * H)
    draft.start(seq)
    draft.set_prompt_features(feats)
    pairs = ([(feats[t], seq[t + 1], t + 1) for t in range(prompt_len - 1)] if prompt_len > 1
             else [(torch.zeros(3 * H), seq[0], 0)])
    with torch.no_grad():
        for _ in range(4):
            n = 9
            toks, par = random_tree(rng, n, V, root=seq[-1])
            tree = make_draft_tree(toks, par, prefix_len=len(seq) - 1)
            dep = depths_of(par)
            got = {0: draft.node_logits(tree, [0])[0]}
            for d in range(1, max(dep) + 1):
                sel = [i for i in range(n) if dep[i] == d and par[i] in got]
                got.update(zip(sel, draft.node_logits(tree, sel)))
            for v, row in got.items():
                ref = chain_logits(head, embed, pairs, [toks[j] for j in path_of(par, v)[1:]])
                fin = torch.isfinite(ref)
                assert torch.equal(fin, torch.isfinite(row))
                torch.testing.assert_close(row[fin], ref[fin], atol=ATOL, rtol=0)
            leaf = rng.randrange(n)
            path = path_of(par, leaf)[: rng.randrange(1, dep[leaf] + 2)]
            emitted = [toks[j] for j in path[1:]] + [rng.randrange(V)]
            f = [torch.randn(3 * H) for _ in path]
            draft.commit(tree, path, emitted, f)
            base = len(seq) - 1
            pairs += [(f[j], emitted[j], base + 1 + j) for j in range(len(path))]
            seq = seq + emitted


def test_features_from_hf_target(llama6):
    """Wiring with a real target: prompt features are read lazily from HFTarget."""
    head = make_head(seed=3)
    target = HFTarget(llama6, capture_layers="eagle3")
    embed = llama6.get_input_embeddings()
    draft = Eagle3Draft(head, embed, features_from=target)
    prompt = [5, 6, 7, 8]
    draft.start(prompt)  # before the target: features are read on the first node_logits
    target.start(prompt)
    tree = make_draft_tree([8, 9], [-1, 0], prefix_len=3)
    with torch.no_grad():
        got = draft.node_logits(tree, [0, 0])
        pf = target.prompt_features()
        ref = chain_logits(head, embed.weight, [(pf[t], prompt[t + 1], t + 1) for t in range(3)], [])
    torch.testing.assert_close(got[1], ref, atol=ATOL, rtol=0)
    tl = target.forward_tree(make_linear([8, 9], [-1, 0], prefix_len=3))
    draft.commit(tree, [0, 1], [9, 4], [tl.features(0), tl.features(1)])
    target.commit([0, 1])
    assert draft.node_logits(make_draft_tree([4], [-1], prefix_len=5), [0]).shape == (1, V)
    target.close()


def test_adapter_errors():
    head = make_head()
    with pytest.raises(ValueError, match="target_embed has shape"):
        Eagle3Draft(head, torch.zeros(V, H + 1))
    draft = Eagle3Draft(head, torch.randn(V, H))
    draft.start([1, 2, 3])
    tree = make_draft_tree([3, 4, 5], [-1, 0, 0], prefix_len=2)
    with pytest.raises(RuntimeError, match="set_prompt_features"):
        draft.node_logits(tree, [0])
    with pytest.raises(ValueError, match="expected"):
        draft.set_prompt_features(torch.zeros(5, 3 * H))
    draft.set_prompt_features(torch.zeros(2, 3 * H))
    with pytest.raises(ValueError, match="forwarded alone"):
        draft.node_logits(tree, [0, 1])
    with pytest.raises(ValueError, match="was not forwarded"):
        draft.node_logits(tree, [1])
    draft.node_logits(tree, [0])
    with pytest.raises(ValueError, match="target feature"):
        draft.commit(tree, [0, 1], [4, 6], [None, None])
    with pytest.raises(ValueError, match="width"):
        head.fuse(torch.zeros(1, 5))


def test_load_eagle3_checkpoint_with_plain_model_and_as_target(tmp_path, llama6):
    """The wiring plan_and_decode uses: as_target(model) + load_eagle3_checkpoint(path, model)."""
    from rheoplan.models import as_target

    head = make_head(seed=4)
    save_eagle3(head, tmp_path)
    draft = load_eagle3_checkpoint(tmp_path, llama6)
    target = as_target(llama6)
    prompt = [5, 6, 7, 8]
    target.start(prompt)
    draft.start(prompt)
    tree = make_draft_tree([8, 9], [-1, 0], prefix_len=3)
    with torch.no_grad():
        got = draft.node_logits(tree, [0])[0]
        ref = chain_logits(head, llama6.get_input_embeddings().weight,
                           [(target.prompt_features()[t], prompt[t + 1], t + 1) for t in range(3)], [])
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    tl = target.forward_tree(make_linear([8, 9], [-1, 0], prefix_len=3))
    draft.commit(tree, [0, 1], [9, 4], [tl.features(0), tl.features(1)])
    # The draft's probe removed its hooks; only the target's three remain.
    assert sum(len(layer._forward_pre_hooks) for layer in llama6.model.layers) == 3
    target.close()


def test_deprecated_loader_names_warn_and_still_load(tmp_path, llama6):
    import rheoplan.models.eagle3 as e3

    head = make_head(seed=5)
    save_eagle3(head, tmp_path)
    with pytest.warns(DeprecationWarning, match=r"read_eagle3\(path\)"):
        back = e3.load_eagle3_head(tmp_path)
    assert torch.equal(back.lm_head.weight, head.lm_head.weight)
    with pytest.warns(DeprecationWarning, match=r"load_eagle3_checkpoint\(path, model\)"):
        d1 = e3.load_eagle3_draft(tmp_path, llama6)
    with pytest.warns(DeprecationWarning, match=r"load_eagle3_checkpoint"):
        d2 = e3.load_eagle3(tmp_path, llama6.get_input_embeddings())
    assert isinstance(d1, Eagle3Draft) and d1.features_from is llama6
    assert isinstance(d2, Eagle3Draft) and d2.features_from is None


def test_one_loader_name_in_rheoplan_models(tmp_path, llama6):
    from rheoplan.models import load_eagle3_checkpoint as public

    save_eagle3(make_head(seed=6), tmp_path)
    draft = public(tmp_path, llama6)
    assert isinstance(draft, Eagle3Draft) and draft.device == llama6.device


@pytest.mark.parametrize("increasing", [True, False])
def test_vocab_logits_are_the_draft_vocabulary_columns(increasing):
    """``vocab_logits`` (what the decode loop asks for) holds the draft vocabulary's logits
    ordered by target id (``vocab_ids``), the finite columns of ``node_logits``; a head whose
    d2t is not increasing gets its columns reordered."""
    head = make_head(seed=6)
    if not increasing:
        head.set_vocab_map(torch.randperm(V, generator=torch.Generator().manual_seed(1))[:60])
    embed = torch.randn(V, H)
    draft = Eagle3Draft(head, embed)
    assert torch.equal(draft.vocab_ids, head.target_ids().sort().values)
    draft.start([1, 2, 3])
    draft.set_prompt_features(torch.randn(2, 3 * H))
    tree = make_draft_tree([3, 4, 5, 6], [-1, 0, 0, 1], prefix_len=2)
    with torch.no_grad():
        rows = {0: draft.vocab_logits(tree, [0])[0]}
        rows.update(zip([1, 2], draft.vocab_logits(tree, [1, 2])))
        rows.update(zip([3], draft.vocab_logits(tree, [3])))
        dense = draft.node_logits(tree, [0, 1, 2, 3])  # served from the step's results
    for v, row in rows.items():
        assert row.shape == (60,) and row.dtype == torch.float32
        assert torch.equal(dense[v, draft.vocab_ids], row)
        assert torch.isinf(dense[v]).sum() == V - 60
    # a head over the whole vocabulary answers densely
    assert Eagle3Draft(make_head(draft_vocab=V), torch.randn(V, H)).vocab_ids is None


def test_tensor_node_ids_equal_list_node_ids():
    """Node ids as a tensor (the device planner's call: no host reads) give the same rows as a
    list of ints (checked against the draft's state)."""
    head = make_head(seed=7)
    embed = torch.randn(V, H)
    feats = torch.randn(3, 3 * H)
    toks, par = random_tree(random.Random(2), 9, V, root=5)
    tree = make_draft_tree(toks, par, prefix_len=3)
    dep = depths_of(par)
    out = []
    for as_tensor in (False, True):
        draft = Eagle3Draft(head, embed)
        draft.start([1, 2, 3, 5])
        draft.set_prompt_features(feats)
        got = {}
        with torch.no_grad():
            for d in range(max(dep) + 1):
                sel = [i for i in range(9) if dep[i] == d]
                ids = torch.tensor(sel) if as_tensor else sel
                got.update(zip(sel, draft.vocab_logits(tree, ids)))
        out.append(torch.stack([got[i] for i in range(9)]))
    assert torch.equal(out[0], out[1])
    with pytest.raises(ValueError, match="root must be forwarded alone"):
        draft = Eagle3Draft(head, embed)
        draft.start([1, 2, 3, 5])
        draft.set_prompt_features(feats)
        draft.vocab_logits(tree, torch.tensor([0, 1]))


@pytest.mark.parametrize("layout", ["features", "hiddens", "mixed"])
def test_batched_call_fuses_every_target_feature_in_one_product(layout):
    """``_fused_hidden``: the target features among a batched call's pairs go through ``fc``
    in one product, the head's own hiddens stay as they are, each in its place."""
    head = make_head(3)
    draft = Eagle3Draft(head, torch.nn.Embedding(V, H))
    g = torch.Generator().manual_seed(1)
    kinds = {"features": "ffff", "hiddens": "hhh", "mixed": "fhffh"}[layout]
    hids = [torch.randn(3 * H if k == "f" else H, generator=g) for k in kinds]
    feat_at = [i for i, k in enumerate(kinds) if k == "f"]
    calls = []
    hook = head.fc.register_forward_hook(lambda m, args, out: calls.append(args[0].shape[0]))
    try:
        with torch.no_grad():
            got = draft._fused_hidden(list(hids), feat_at)
    finally:
        hook.remove()
    assert calls == ([len(feat_at)] if feat_at else [])
    with torch.no_grad():
        for i, (k, x) in enumerate(zip(kinds, hids)):
            if k == "h":
                assert torch.equal(got[i], x)
            else:
                assert torch.allclose(got[i], head.fuse(x), atol=ATOL)
