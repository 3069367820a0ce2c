"""Tiny models and checks shared by the decode-loop tests (test_decode, test_fuzz,
test_determinism, test_validation). No downloads: every model is random-initialised."""

from __future__ import annotations

import torch

from rheoplan.models.functional import FunctionalLM


def tiny_llama(seed: int = 0, vocab: int = 6, hidden: int = 16, layers: int = 1,
               head_scale: float = 4.0, max_pos: int = 128, dtype: torch.dtype = torch.float32):
    """A random Llama small enough that one forward costs well under a millisecond.

    ``head_scale`` multiplies the lm_head: random init gives near-flat logits; a larger head
    gives varied, non-degenerate next-token laws (and distinct argmaxes for greedy tests).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, vocab_size=vocab,
                      max_position_embeddings=max_pos, tie_word_embeddings=False,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    return model.to(dtype)


def full_logits(model, ids: list[int]) -> torch.Tensor:
    """Plain causal forward of the whole sequence (no cache, no tree): logits ``[n, V]``."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def hf_as_functional(model) -> FunctionalLM:
    """The exact law of an HF model as a FunctionalLM: a plain forward over the full path,
    the last position's logits (memoised; the oracle revisits paths)."""
    memo: dict[tuple[int, ...], torch.Tensor] = {}

    def fn(paths):
        rows = []
        for p in paths:
            if p not in memo:
                memo[p] = full_logits(model, list(p))[-1]
            rows.append(memo[p])
        return torch.stack(rows)

    return FunctionalLM(fn, int(model.config.vocab_size))


def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    """transformers' own greedy ``generate`` (no cache tricks of ours)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def generate_processors(model, sampling, extra=(), prompt_len: int = 3):
    """The processors ``model.generate`` applies for ``sampling`` (and ``extra`` passed as
    ``logits_processor=``), built by transformers itself."""
    from transformers import GenerationConfig, LogitsProcessorList

    kw = dict(do_sample=not sampling.greedy, top_k=sampling.top_k, top_p=sampling.top_p,
              typical_p=sampling.typical_p, repetition_penalty=sampling.repetition_penalty)
    if not sampling.greedy:
        kw["temperature"] = sampling.temperature
    if sampling.min_p > 0:
        kw["min_p"] = sampling.min_p
    gc, _ = model._prepare_generation_config(GenerationConfig(**kw))
    return model._get_logits_processor(
        generation_config=gc, input_ids_seq_length=prompt_len,
        encoder_input_ids=torch.zeros(1, prompt_len, dtype=torch.long),
        logits_processor=LogitsProcessorList(extra), device="cpu",
        model_kwargs={"attention_mask": torch.ones(1, prompt_len, dtype=torch.long)})


def chain_lm(vocab: int, sharp: float = 40.0) -> FunctionalLM:
    """Next token = (last + 1) % vocab with near-certainty: a draft equal to it is always right."""

    def fn(paths):
        out = torch.zeros(len(paths), vocab)
        for r, p in enumerate(paths):
            out[r, (p[-1] + 1) % vocab] = sharp
        return out

    return FunctionalLM(fn, vocab)


def nan_lm(vocab: int, value: float = float("nan")) -> FunctionalLM:
    return FunctionalLM(lambda paths: torch.full((len(paths), vocab), value), vocab)


def check_cache_matches_fresh_forward(target_adapter, model, full_ids: list[int], atol: float = 1e-4) -> None:
    """The adapter's compacted KV cache (committed entries only) equals, layer by layer, the
    cache of a fresh forward of the committed tokens; and the logits of a root-only verify
    forward from it equal a fresh forward of committed + root.

    ``full_ids`` = prompt + every emitted token; the committed tokens are its first
    ``cached_len`` entries and the next root is the one after them.
    """
    from transformers import DynamicCache

    from rheoplan import SamplingConfig, TreeConfig
    from rheoplan.pipeline import PassContext
    from rheoplan.planner.linearize import linearize
    from rheoplan.ir import empty_tree

    n = target_adapter.cached_len
    committed = full_ids[:n]
    from rheoplan.models._hf_common import _cache_kwarg

    fresh = DynamicCache(config=model.config)
    if committed:  # a 1-token prompt with nothing committed yet has an empty cache
        with torch.no_grad():
            model(input_ids=torch.tensor([committed]), use_cache=True, **{_cache_kwarg(model): fresh})
    cache = target_adapter.cache
    assert target_adapter.cached_len == n and cache.get_seq_length() >= n
    for layer, ref in zip(cache.layers, fresh.layers) if committed else ():
        k = layer.keys[..., :n, :]
        v = layer.values[..., :n, :]
        assert k.shape == ref.keys.shape, (k.shape, ref.keys.shape)
        torch.testing.assert_close(k, ref.keys, atol=atol, rtol=1e-4)
        torch.testing.assert_close(v, ref.values, atol=atol, rtol=1e-4)
    root = full_ids[n]
    cfg = TreeConfig(depth=1, frontier=1, slots=1, budget=1, support=1)
    t = empty_tree(1, 1, 1, 1, torch.tensor([root]), torch.tensor([n]), 1, 1)
    lin = linearize(t, PassContext(tree_cfg=cfg, sampling=SamplingConfig())).linear
    got = target_adapter.forward_tree(lin).logits(0)
    want = full_logits(model, committed + [root])[-1]
    torch.testing.assert_close(got, want, atol=atol, rtol=1e-4)


def random_eagle3_head(vocab: int, draft_vocab: int, seed: int, vocab_map: torch.Tensor | None = None,
                       hidden: int = 32):
    """A tiny EAGLE-3 head with random weights (std 0.3, so its drafts are far from uniform)
    over ``draft_vocab`` of the ``vocab`` target ids, in eval mode: ``vocab_map`` (increasing
    target ids), or, when None, a random choice drawn after the weights from the same seed."""
    from rheoplan.models.eagle3 import Eagle3Config, Eagle3Head

    cfg = Eagle3Config(vocab_size=vocab, draft_vocab_size=draft_vocab, hidden_size=hidden,
                       intermediate_size=2 * hidden, num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(seed)
    head = Eagle3Head(cfg)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3)
        if vocab_map is None:
            vocab_map = torch.randperm(vocab)[:draft_vocab].sort().values
        head.set_vocab_map(vocab_map)
    return head.eval()
