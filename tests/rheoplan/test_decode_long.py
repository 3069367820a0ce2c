"""Long and interrupted decodes: a 5,000-token decode keeps memory flat and the committed
KV cache equal to prompt + emitted tokens; an exception or a KeyboardInterrupt raised in the
streaming callback leaves no hooks on the model, and the model and the draft decode the
next call exactly as if nothing had happened."""

from __future__ import annotations

import gc
import os
import resource

import pytest
import torch

from _decode_models import check_cache_matches_fresh_forward, random_eagle3_head, tiny_llama
from rheoplan import SamplingConfig, TreeConfig
from rheoplan.decode import plan_and_decode
from rheoplan.models.hf_target import HFTarget

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LONG = 5000
TREE = TreeConfig(depth=3, frontier=2, slots=2, budget=4, rheostat=1, support=16)


def rss_bytes() -> int:
    """Resident set size now (Linux /proc), else the peak (``ru_maxrss``, KiB on Linux)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def hooks_on(model) -> int:
    mods = list(model.modules())
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in mods)


@pytest.mark.slow
@pytest.mark.no_ir_lint
def test_5000_token_decode_keeps_memory_flat_and_the_cache_exact(record_property):
    # The model drafts for itself along a deep chain (draft law == target law, so every
    # drafted token is accepted): 13 tokens per step, ~385 steps for 5,000 tokens.
    model = tiny_llama(31, vocab=16, hidden=16, layers=2, head_scale=3.0, max_pos=LONG + 64)
    prompt = [1, 5, 9]
    adapter = HFTarget(model)
    rss = {}

    def watch(tokens, seen=[0]):
        seen[0] += len(tokens)
        for mark in (500, 2500):
            if mark not in rss and seen[0] >= mark:
                gc.collect()
                rss[mark] = rss_bytes()

    r = plan_and_decode(adapter, model, prompt, max_new_tokens=LONG, tree=TreeConfig.chain(depth=12, support=16),
                        seed=7, sampling=SamplingConfig(temperature=1.0), callback=watch)
    gc.collect()
    rss["end"] = rss_bytes()
    growth = rss["end"] - rss[500]
    record_property("rss_growth_mib_500_to_5000", growth / 2**20)
    record_property("rss_mib", {k: v / 2**20 for k, v in rss.items()})
    record_property("steps", len(r.steps))
    assert len(r.tokens) == LONG and sum(s.accepted for s in r.steps) > 0
    # The KV caches of 5,000 tokens of this model (target + draft) are ~2.6 MB; everything
    # else a step makes must be freed. 32 MiB over 4,500 tokens (~350 steps) is ~90 KiB
    # per step: keeping one step's tree, logits or cache copies would exceed it.
    assert growth < 32 * 2**20, rss
    # Committed: the prompt but its last token (the first root), then every step's root and
    # accepted tokens (= its emitted tokens) except the last step's, which is not committed.
    assert adapter.cached_len == len(prompt) - 1 + LONG - r.steps[-1].emitted
    check_cache_matches_fresh_forward(adapter, model, prompt + r.tokens, atol=2e-4)
    adapter.close()


class Stop(Exception):
    pass


def _raise_after(n_calls: int, exc: BaseException):
    calls = [0]

    def cb(tokens):
        calls[0] += 1
        if calls[0] >= n_calls:
            raise exc

    return cb


@pytest.fixture(scope="module")
def pair4():
    from rheoplan.models.eagle3 import Eagle3Draft

    target = tiny_llama(41, vocab=16, hidden=32, layers=4, head_scale=3.0)
    head = random_eagle3_head(16, 12, seed=0, vocab_map=torch.arange(12) + 2)
    eagle = Eagle3Draft(head, target.get_input_embeddings(), features_from=target)
    return target, {"llama": tiny_llama(42, vocab=16, hidden=32, layers=1, head_scale=3.0), "eagle3": eagle}


@pytest.mark.parametrize("exc", [Stop("user code failed"), KeyboardInterrupt()], ids=["exception", "ctrl-c"])
@pytest.mark.parametrize("draft_kind", ["llama", "eagle3"])
def test_interrupted_decode_leaves_no_hooks_and_models_reusable(pair4, exc, draft_kind):
    target, drafts = pair4
    draft = drafts[draft_kind]
    kw = dict(max_new_tokens=30, tree=TREE, seed=3, sampling=SamplingConfig(temperature=0.8, top_p=0.9))
    before = plan_and_decode(target, draft, [1, 2, 3, 4], **kw).tokens
    assert hooks_on(target) == 0
    with pytest.raises(type(exc)):
        plan_and_decode(target, draft, [5, 6, 7], callback=_raise_after(3, exc), **kw)
    assert hooks_on(target) == 0, "the interrupted decode left hooks on the model"
    again = plan_and_decode(target, draft, [1, 2, 3, 4], **kw).tokens
    assert again == before


def test_interrupted_decode_through_a_callers_adapter_keeps_it_usable(pair4):
    """An adapter the caller built stays open (the caller owns it) and serves the next call."""
    target, drafts = pair4
    adapter = HFTarget(target, capture_layers="eagle3")
    kw = dict(max_new_tokens=20, tree=TREE, seed=5, sampling=SamplingConfig(temperature=1.0))
    with pytest.raises(KeyboardInterrupt):
        plan_and_decode(adapter, drafts["eagle3"], [3, 4, 5], callback=_raise_after(2, KeyboardInterrupt()), **kw)
    r = plan_and_decode(adapter, drafts["eagle3"], [1, 2, 3, 4], **kw)
    assert r.tokens == plan_and_decode(target, drafts["eagle3"], [1, 2, 3, 4], **kw).tokens
    check_cache_matches_fresh_forward(adapter, target, [1, 2, 3, 4] + r.tokens)
    adapter.close()
    assert hooks_on(target) == 0
