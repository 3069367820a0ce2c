"""Batched decoding: ``plan_and_decode`` with several prompts (docs/batch.md).

* exactness per row: every row of a batch emits the tokens of a batch of one decoding
  that row with the same stream id (functional models, transformers models, every draft
  kind, greedy and sampled); greedy rows equal transformers' ``generate`` (float32);
* statistics through the real loop: each row's law is the target law (functional models,
  with the rows' joint law the product of their laws; a tiny transformers Llama at batch 4
  with different prompt lengths and EOS in some rows), and the mutation controls
  ``batch_shift_rows`` / ``batch_keep_first_rows`` (``rheoplan.mutation``) are caught;
* continuous batching (``max_batch_size``): rows joining a running batch still equal their
  batch of one;
* bad input: a clear error naming the parameter and the row, before any model work.

Chi-square verdicts as in test_decode.py (ALPHA per case; Bonferroni over the rows).
"""

from __future__ import annotations

import pytest
import torch

from _decode_models import greedy_reference, hf_as_functional, random_eagle3_head, tiny_llama
from rheoplan import SamplingConfig, TreeConfig
from rheoplan.costmodel import Calibration
from rheoplan.decode import DecodeResult, plan_and_decode
from rheoplan.models.functional import hashed_context_lm
from rheoplan.testing import chi_square, exact_law, mutation, target_law, total_variation

ALPHA = 1e-3
SEED0 = 5000
GREEDY = SamplingConfig(temperature=0)
TREE = TreeConfig(depth=3, frontier=2, slots=2, budget=5, rheostat=1, support=6)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _rows_alone(target, draft, prompts, limits, **kw) -> list[list[int]]:
    """Each row decoded in a batch of one with its own stream id."""
    return [plan_and_decode(target, draft, [p], max_new_tokens=n, stream_ids=[b], **kw)[0].tokens
            for b, (p, n) in enumerate(zip(prompts, limits))]


def _spy(monkeypatch, owner, name: str, keep) -> list:
    """Wrap method ``owner.name``: every call appends ``keep(*args)`` (the call's arguments
    after ``self``) to the returned list, then runs the method."""
    seen = []
    real = getattr(owner, name)

    def wrapper(self, *args):
        seen.append(keep(*args))
        return real(self, *args)

    monkeypatch.setattr(owner, name, wrapper)
    return seen


def _truncate_at_eos(law, eos):
    """The law of the emitted tokens when the decode stops at the first EOS (included)."""
    out: dict[tuple[int, ...], float] = {}
    for seq, p in law.items():
        cut = next((j + 1 for j, t in enumerate(seq) if t in eos), len(seq))
        out[seq[:cut]] = out.get(seq[:cut], 0.0) + p
    return out


# --------------------------------------------------------------------------------------
# Rows are independent of their batch: row b == a batch of one with stream id b
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["reference", "numba"])
@pytest.mark.parametrize("with_draft", [True, False], ids=["tree", "autoregressive"])
def test_functional_rows_equal_batch_of_one(backend, with_draft):
    tgt, drf = hashed_context_lm(6, seed=1), hashed_context_lm(6, seed=2)
    prompts, limits = [[0, 1], [2, 3, 4], [5], [1, 1]], [5, 8, 3, 6]
    draft = drf if with_draft else None
    for seed in range(3):
        rs = plan_and_decode(tgt, draft, prompts, max_new_tokens=limits, seed=seed, tree=TREE,
                             backend=backend, eos_token_id=4)
        assert isinstance(rs, list) and all(isinstance(r, DecodeResult) for r in rs)
        alone = _rows_alone(tgt, draft, prompts, limits, seed=seed, tree=TREE, backend=backend, eos_token_id=4)
        assert [r.tokens for r in rs] == alone
        # a single sequence is stream 0: row 0 of the batch
        single = plan_and_decode(tgt, draft, prompts[0], max_new_tokens=limits[0], seed=seed, tree=TREE,
                                 backend=backend, eos_token_id=4)
        assert isinstance(single, DecodeResult) and single.tokens == rs[0].tokens
        for r, n in zip(rs, limits):
            assert (r.stopped_by == "eos") == (4 in r.tokens)
            assert len(r.tokens) == n or r.tokens[-1] == 4


def test_rows_equal_batch_of_one_on_extreme_models():
    """Row b of a batch is row b decoded alone with stream id b, for random small trees,
    sampling settings, backends, EOS and per-row limits, on models whose logits sit at the
    edges of float32 (``test_backends._extreme_lm``) or hashed-context models; or both
    raise the same error (a broken output of one row stops the batch). Not with a cost
    model: it plans the batch as a whole, so a row's trees, and with them its tokens (never
    its law), differ from the row's alone."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    settings(max_examples=80, deadline=None, derandomize=True)(given(st.data())(_batch_matches_rows_alone))()


def _batch_matches_rows_alone(data) -> None:
    from hypothesis import strategies as st

    from test_backends import _extreme_lm

    V = data.draw(st.sampled_from([3, 5, 17]), label="V")
    K = data.draw(st.integers(1, min(V, 3)), label="slots")
    tree = TreeConfig(depth=data.draw(st.integers(1, 3)), frontier=data.draw(st.integers(1, 2)), slots=K,
                      budget=data.draw(st.integers(1, 6)), rheostat=data.draw(st.integers(0, K)),
                      support=data.draw(st.integers(K, V + 2)), verifier=data.draw(st.sampled_from(["rheo", "ot"])))
    kw = dict(tree=tree, seed=data.draw(st.integers(0, 2**20), label="seed"),
              sampling=SamplingConfig(temperature=data.draw(st.sampled_from([0.0, 0.5, 1.0]))),
              backend=data.draw(st.sampled_from(["reference", "numba"])),
              eos_token_id=data.draw(st.sampled_from([None, 0, V - 1])))
    extreme = data.draw(st.booleans(), label="extreme")
    tgt, drf = ((_extreme_lm(V, 2 * kw["seed"] + i) if extreme else hashed_context_lm(V, seed=2 * kw["seed"] + i))
                for i in (0, 1))
    B = data.draw(st.integers(2, 4), label="rows")
    prompts = [data.draw(st.lists(st.integers(0, V - 1), min_size=1, max_size=4)) for _ in range(B)]
    limits = [data.draw(st.integers(1, 6)) for _ in range(B)]

    def run(f):
        try:
            return f()
        except (ValueError, RuntimeError) as e:  # PassError is a RuntimeError
            return f"{type(e).__name__}: {e}"

    batch = run(lambda: [r.tokens for r in plan_and_decode(tgt, drf, prompts, max_new_tokens=limits, **kw)])
    alone = [run(lambda b=b: plan_and_decode(tgt, drf, [prompts[b]], max_new_tokens=limits[b], stream_ids=[b],
                                             **kw)[0].tokens) for b in range(B)]
    if isinstance(batch, str):  # a broken output of one row stops the batch; that row alone raises it too
        assert batch in alone
    else:
        assert batch == alone


def test_batched_loop_equals_the_oracles_reference_loop():
    """``rheoplan.testing.functional_decode_batch`` (the loop the statistical oracle tests
    check against the exact law) gives run ``r`` stream id ``r``, as the batched loop gives
    row ``r``: for every seed the two emit the same tokens, row by row (the functional
    target serves step 0 from the prompt: ``plain_first``). So each row of a batch has the
    law the oracle proves for one decode (``exact_law == target_law``)."""
    from rheoplan.testing import functional_decode_batch

    tgt, drf = hashed_context_lm(5, seed=3), hashed_context_lm(5, seed=4, sharpness=0.5)
    cfg = TreeConfig(depth=2, frontier=2, slots=3, budget=4, rheostat=1, support=5)
    s = SamplingConfig(temperature=0.8, top_k=4)
    assert total_variation(exact_law(tgt, drf, (0, 1), 2, tree=cfg, sampling=s), target_law(tgt, (0, 1), 2, s)) < 1e-9
    for seed in range(20):
        rows = plan_and_decode(tgt, drf, [[0, 1]] * 4, max_new_tokens=6, seed=seed, tree=cfg, sampling=s)
        want = functional_decode_batch(tgt, drf, [0, 1], 6, 4, tree=cfg, sampling=s, seed=seed, plain_first=True)
        assert [tuple(r.tokens) for r in rows] == want


def test_same_seed_and_row_give_the_same_tokens_whatever_the_other_rows():
    tgt, drf = hashed_context_lm(6, seed=1), hashed_context_lm(6, seed=2)
    a = plan_and_decode(tgt, drf, [[0, 1], [2, 3]], max_new_tokens=10, seed=7, tree=TREE)
    b = plan_and_decode(tgt, drf, [[0, 1], [2, 3]], max_new_tokens=10, seed=7, tree=TREE)
    c = plan_and_decode(tgt, drf, [[5, 5, 5], [2, 3], [1]], max_new_tokens=[3, 10, 4], seed=7, tree=TREE,
                        stream_ids=[9, 1, 4])
    assert [r.tokens for r in a] == [r.tokens for r in b]
    assert c[1].tokens == a[1].tokens  # same prompt, seed and stream id 1, other rows differ
    d = plan_and_decode(tgt, drf, [[0, 1], [2, 3]], max_new_tokens=10, seed=8, tree=TREE)
    assert [r.tokens for r in d] != [r.tokens for r in a]


@pytest.fixture(scope="module")
def llamas():
    target = tiny_llama(2, vocab=32, hidden=32, layers=4, head_scale=20.0)
    draft = tiny_llama(3, vocab=32, hidden=32, layers=2, head_scale=20.0)
    return target, draft


def _eagle3(target):
    from rheoplan.models.eagle3 import Eagle3Draft

    head = random_eagle3_head(32, 24, seed=5)
    return Eagle3Draft(head, target.get_input_embeddings(), features_from=target)


PROMPTS = [[1, 2, 3, 4], [7], [9, 8, 7, 6, 5, 4, 3, 2, 1], [3, 3]]
LIMITS = [12, 16, 5, 14]
TREE_HF = TreeConfig(depth=3, frontier=2, slots=3, budget=6, rheostat=1, support=32)


@pytest.mark.parametrize("draft_kind", ["none", "llama", "eagle3"])
def test_greedy_rows_equal_generate_and_batch_of_one(llamas, draft_kind):
    """float32: every greedy row equals transformers' greedy ``generate`` of that prompt."""
    target, draft = llamas
    drf = {"none": None, "llama": draft, "eagle3": _eagle3(target) if draft_kind == "eagle3" else None}[draft_kind]
    rs = plan_and_decode(target, drf, PROMPTS, max_new_tokens=LIMITS, sampling=GREEDY, tree=TREE_HF, seed=0)
    for p, n, r in zip(PROMPTS, LIMITS, rs):
        assert r.tokens == greedy_reference(target, p, n)
    # the adapter built inside the loop removed its capture hooks
    assert sum(len(layer._forward_pre_hooks) for layer in target.model.layers) == 0


def test_greedy_batch_reads_its_prefetched_nodes_in_one_pass(llamas, monkeypatch):
    """A greedy batch computes the greedy token of every row's prefetched likely path in one
    ``greedy_tokens`` call a step (``decode._greedy_rows``); the walks read logits one node
    at a time only off those paths. The tokens stay ``generate``'s."""
    import rheoplan.decode as decode_mod
    import rheoplan.verify as verify_mod

    target, draft = llamas
    batched, per_node = [], []
    real_batch, real_node = decode_mod.greedy_tokens, verify_mod.greedy_tokens
    monkeypatch.setattr(decode_mod, "greedy_tokens", lambda x, *a, **k: batched.append(x.shape[0]) or real_batch(x, *a, **k))
    monkeypatch.setattr(verify_mod, "greedy_tokens", lambda x, *a, **k: per_node.append(1) or real_node(x, *a, **k))
    rs = plan_and_decode(target, draft, PROMPTS, max_new_tokens=LIMITS, sampling=GREEDY, tree=TREE_HF, seed=0)
    for p, n, r in zip(PROMPTS, LIMITS, rs):
        assert r.tokens == greedy_reference(target, p, n)
    visited = sum(st.visited for r in rs for st in r.steps if st.drafted)
    assert batched and sum(batched) >= len(batched) * 2  # several rows' nodes a call
    assert len(per_node) < visited / 2  # most visited nodes were read in the batched pass


def test_rows_of_one_projection_are_found_in_place():
    """``_rows_of_one_block``: rows that are whole rows of one contiguous output (what
    ``prefetch_rows`` stores) are located in it; a copy, a row of another tensor or a part
    of a row is not."""
    from rheoplan.decode import _rows_of_one_block

    out = torch.randn(7, 11)
    parts = out.split([3, 4])
    rows = [parts[1][2], parts[0][0], parts[1][0]]
    block, at = _rows_of_one_block(rows)
    assert block is out and at == [5, 0, 3]
    assert all(torch.equal(out[i], r) for i, r in zip(at, rows))
    assert _rows_of_one_block([parts[0][0], out[1].clone()]) is None
    assert _rows_of_one_block([out[0], torch.randn(7, 11)[1]]) is None
    assert _rows_of_one_block([out[0, :5]]) is None
    assert _rows_of_one_block([out.t()[0]]) is None


@pytest.mark.parametrize("draft_kind", ["none", "eagle3"])
def test_rows_prefilled_in_groups_still_equal_generate(llamas, draft_kind, monkeypatch):
    """With a cost model the batched loop prefills prompts of similar lengths together
    (``prefill_groups`` over the measured cost of a forward): greedy rows still equal
    ``generate`` (float32), the joining rows of continuous batching too, and the groups
    were not one forward."""
    from rheoplan.costmodel import CostModel, Timings
    from rheoplan.models.hf_target import HFTarget

    seen = _spy(monkeypatch, HFTarget, "_prefill_groups", lambda ids, with_root, groups: groups)
    # a forward's fixed cost is 2 tokens' worth: prompts of 1..9 tokens split into groups
    tm = Timings((1, 64), (2.0, 65.0), (2.0, 65.0), 0, 1000, (1, 64), (0.1, 0.5), 0.05, 0.05)
    target, _ = llamas
    drf = None if draft_kind == "none" else _eagle3(target)
    for max_batch in (None, 3):
        seen.clear()
        rs = plan_and_decode(target, drf, PROMPTS, max_new_tokens=LIMITS, sampling=GREEDY, tree=TREE_HF, seed=0,
                             cost_model=CostModel(tm), max_batch_size=max_batch)
        assert [r.tokens for r in rs] == [greedy_reference(target, p, n) for p, n in zip(PROMPTS, LIMITS)]
        assert seen and len(seen[0]) > 1


@pytest.mark.parametrize("draft_kind", ["llama", "eagle3"])
def test_sampled_rows_equal_batch_of_one_hf(llamas, draft_kind):
    """T = 1 through the batched KV caches (target and draft): the same tokens as each row alone."""
    target, draft = llamas
    drf = draft if draft_kind == "llama" else _eagle3(target)
    kw = dict(sampling=SamplingConfig(), tree=TREE_HF, seed=11, eos_token_id=5)
    rs = plan_and_decode(target, drf, PROMPTS, max_new_tokens=LIMITS, **kw)
    assert [r.tokens for r in rs] == _rows_alone(target, drf, PROMPTS, LIMITS, **kw)


def test_one_row_through_the_batched_caches_equals_the_single_sequence_loop(llamas):
    """T = 1 with the target as its own draft: most drafted tokens are accepted, often on a
    node that is not its parent's first child, so commits move tree entries inside the
    batched caches (``RowCache.commit_paths``). A batch of one prompt (stream 0) gives the
    single-sequence loop's tokens, whose caches are transformers' own."""
    target, _ = llamas
    kw = dict(sampling=SamplingConfig(), tree=TREE_HF, seed=3)
    for p, n in zip(PROMPTS, LIMITS):
        single = plan_and_decode(target, target, p, max_new_tokens=n, **kw)
        assert sum(st.accepted for st in single.steps) >= n // 3  # the trees are mostly accepted
        assert plan_and_decode(target, target, [p], max_new_tokens=n, **kw)[0].tokens == single.tokens


@pytest.mark.parametrize("backend", ["reference", "numba"])
def test_continuous_batching_rows_equal_batch_of_one_functional(backend):
    """max_batch_size=2 over 6 prompts: waiting prompts join as rows finish (at different
    steps of the others' decodes); each row still draws from its own stream, counting its
    own steps, so it equals its batch of one."""
    tgt, drf = hashed_context_lm(6, seed=1), hashed_context_lm(6, seed=2)
    prompts, limits = [[0, 1], [2, 3, 4], [5], [1, 1], [3], [4, 4, 4]], [5, 12, 3, 7, 2, 9]
    kw = dict(seed=3, tree=TREE, backend=backend, eos_token_id=4)
    seen: list[int] = []
    rs = plan_and_decode(tgt, drf, prompts, max_new_tokens=limits, max_batch_size=2,
                         callback=lambda row, toks: seen.append(row), **kw)
    assert [r.tokens for r in rs] == _rows_alone(tgt, drf, prompts, limits, **kw)
    assert seen.index(5) > seen.index(1)  # the last prompt waited


@pytest.mark.parametrize("draft_kind", ["llama", "eagle3"])
def test_continuous_batching_rows_equal_batch_of_one_hf(llamas, draft_kind):
    """Rows joining a running batch (prefilled on their own, appended to the batched caches)."""
    target, draft = llamas
    drf = draft if draft_kind == "llama" else _eagle3(target)
    prompts, limits = PROMPTS + [[4], [5, 6, 7]], LIMITS + [3, 8]
    kw = dict(sampling=SamplingConfig(), tree=TREE_HF, seed=11, eos_token_id=5)
    rs = plan_and_decode(target, drf, prompts, max_new_tokens=limits, max_batch_size=3, **kw)
    assert [r.tokens for r in rs] == _rows_alone(target, drf, prompts, limits, **kw)
    greedy = plan_and_decode(target, drf, prompts, max_new_tokens=limits, max_batch_size=2, sampling=GREEDY,
                             tree=TREE_HF, seed=0)
    assert [r.tokens for r in greedy] == [greedy_reference(target, p, n) for p, n in zip(prompts, limits)]


def test_batched_eagle3_equals_its_batch_1_code_row_by_row(llamas):
    """``Eagle3Draft``'s batched methods (one flat head call per depth for every row) give the
    tokens of the default row-by-row methods, which run its batch-1 code on a copy per row."""
    from rheoplan.models.base import DraftModel
    from rheoplan.models.eagle3 import Eagle3Draft

    class RowCopies(Eagle3Draft):
        start_rows, add_rows, keep_rows = DraftModel.start_rows, DraftModel.add_rows, DraftModel.keep_rows
        commit_rows, node_logits_rows = DraftModel.commit_rows, DraftModel.node_logits_rows
        vocab_logits_rows = DraftModel.vocab_logits_rows
        take_prompt_features_rows = DraftModel.take_prompt_features_rows

    target, _ = llamas
    batched = _eagle3(target)
    copies = RowCopies(batched.head, target.get_input_embeddings(), features_from=target)
    prompts, limits = PROMPTS + [[4], [5, 6, 7]], [30, 40, 12, 25, 5, 16]
    for max_batch in (None, 2):
        kw = dict(max_new_tokens=limits, seed=4, tree=TREE_HF, max_batch_size=max_batch)
        a = plan_and_decode(target, batched, prompts, **kw)
        b = plan_and_decode(target, copies, prompts, **kw)
        assert [r.tokens for r in a] == [r.tokens for r in b]
        assert [r.mean_accepted_length for r in a] == [r.mean_accepted_length for r in b]


def test_padded_tensor_with_attention_mask_equals_lists(llamas):
    target, draft = llamas
    n = max(len(p) for p in PROMPTS)
    ids = torch.zeros(len(PROMPTS), n, dtype=torch.int64)
    mask = torch.zeros(len(PROMPTS), n, dtype=torch.int64)
    for b, p in enumerate(PROMPTS):  # left padding, as a transformers tokenizer makes it
        ids[b, n - len(p):] = torch.tensor(p)
        mask[b, n - len(p):] = 1
    kw = dict(max_new_tokens=6, sampling=SamplingConfig(), tree=TREE_HF, seed=2)
    a = plan_and_decode(target, draft, ids, attention_mask=mask, **kw)
    b = plan_and_decode(target, draft, PROMPTS, **kw)
    assert [r.tokens for r in a] == [r.tokens for r in b]


def test_callback_gets_row_and_tokens():
    tgt, drf = hashed_context_lm(6, seed=1), hashed_context_lm(6, seed=2)
    seen: dict[int, list[int]] = {}
    rs = plan_and_decode(tgt, drf, [[0, 1], [2]], max_new_tokens=[4, 9], seed=3, tree=TREE,
                         callback=lambda row, toks: seen.setdefault(row, []).extend(toks))
    assert seen == {0: rs[0].tokens, 1: rs[1].tokens}
    # rows leave the batch: row 0 takes fewer steps than row 1
    assert len(rs[0].steps) <= len(rs[1].steps)


def test_cost_model_prices_the_live_batch(monkeypatch):
    """The cost passes see every live row's tree: the batched verify cost is asked with the
    number of live rows, which falls as rows finish."""
    from rheoplan.costmodel import CostModel, Timings

    sizes = _spy(monkeypatch, Timings, "verify_batch", lambda batch, row_tokens, ctx: batch)
    tm = Timings((1, 64), (1.0, 60.0), (1.2, 70.0), 0, 1000, (1, 64), (0.1, 0.5), 0.05, 0.05)
    tgt, drf = hashed_context_lm(6, seed=1), hashed_context_lm(6, seed=2)
    rs = plan_and_decode(tgt, drf, [[0, 1], [2], [3]], max_new_tokens=[2, 12, 6], seed=3, tree=TREE,
                         cost_model=CostModel(tm))
    assert [len(r.tokens) for r in rs] == [2, 12, 6]
    assert sizes and sizes[0] == 3 and min(sizes) == 1 and sorted(sizes, reverse=True) == sizes
    assert all(st.predicted_tokens is not None for r in rs for st in r.steps)


def test_batch_drafts_only_while_a_tree_can_pay():
    """Several live rows draft only while ``plan_rows`` finds a tree that pays a priori:
    with a verify forward whose cost grows with every batch token and a costly batched
    step, no row drafts while three are live; once one row is left, it asks the head at
    every step, as a single sequence does."""
    from rheoplan.costmodel import CostModel, Timings

    tm = Timings((1, 64), (1.0, 64.0), (1.0, 64.0), 0, 1000, (1, 64), (0.5, 0.5), 0.05, 0.05,
                 batch_sizes=(1, 4), batch_row_sizes=(1, 8), batch_verify=((1.0, 8.0), (4.0, 32.0)),
                 batch_draft_ms=(0.5, 2.0), batch_draft_width=1.0, batch_overhead_ms=(0.05, 20.0),
                 batch_ar_overhead_ms=(0.05, 0.2))
    cost = CostModel(tm)
    assert cost.plan_rows(3, ctx=8, max_depth=TREE.depth, max_width=2, calibration=Calibration()).depth == 0
    tgt, drf = hashed_context_lm(6, seed=1), hashed_context_lm(6, seed=2)
    rs = plan_and_decode(tgt, drf, [[0, 1], [2], [3]], max_new_tokens=[3, 3, 12], seed=3, tree=TREE,
                         cost_model=cost)
    steps = rs[2].steps
    assert not any(st.drafted for st in steps[:2])  # three rows live: no draft call at all
    assert any(st.drafted for st in steps[3:])  # one row: asks the head at every step
    assert [len(r.tokens) for r in rs] == [3, 3, 12]


def test_a_lone_rows_fused_plan_decodes_as_the_pass_list(monkeypatch):
    """One live row plans with the cost passes as a single sequence does, fused
    (``kernels/plan/cpu_pipeline``) unless a pass list is given: the same tokens and steps
    either way, the fused plan run for the lone row's steps only."""
    from rheoplan import decode
    from rheoplan.costmodel import CostModel, Timings
    from rheoplan.kernels.plan import cpu_pipeline
    from rheoplan.planner.default import DEFAULT_PIPELINE

    fused, trees = [], []
    real, real_rows = cpu_pipeline.plan_cost_tree, decode._plan_rows
    monkeypatch.setattr(decode, "plan_cost_tree", lambda *a, **k: fused.append(1) or real(*a, **k))

    def recording(*a):  # read each tree in its step: a fused plan's tables are the next step's
        t = real_rows(*a)
        trees.append((t.token.tolist(), t.linear.token.tolist()))
        return t

    monkeypatch.setattr(decode, "_plan_rows", recording)
    tm = Timings((1, 64), (1.0, 64.0), (1.0, 64.0), 0, 1000, (1, 64), (0.5, 0.5), 0.05, 0.05,
                 batch_sizes=(1, 4), batch_row_sizes=(1, 8), batch_verify=((1.0, 8.0), (4.0, 32.0)),
                 batch_draft_ms=(0.5, 2.0), batch_draft_width=1.0, batch_overhead_ms=(0.05, 20.0),
                 batch_ar_overhead_ms=(0.05, 0.2))
    tgt, drf = hashed_context_lm(6, seed=1), hashed_context_lm(6, seed=2)
    runs, planned = [], []
    for p in (None, DEFAULT_PIPELINE):
        runs.append(plan_and_decode(tgt, drf, [[0, 1], [2], [3]], max_new_tokens=[3, 3, 16], seed=3, tree=TREE,
                                    cost_model=CostModel(tm), passes=p, stream_ids=[4, 9, 7]))
        planned.append(list(trees))
        trees.clear()
    assert 0 < len(fused) < len(runs[0][2].steps)  # the lone row's steps, not the batch's
    assert planned[0] == planned[1]  # the same trees, drawn from the row's own streams
    for a, b in zip(*runs):
        assert a.tokens == b.tokens
        assert ([(st.tree_size, st.drafted, st.predicted_tokens) for st in a.steps]
                == [(st.tree_size, st.drafted, st.predicted_tokens) for st in b.steps])


def _plans_seen(monkeypatch) -> list:
    """Spy on ``decode._rows_plan``: ``(live rows, rows waiting, the plan or None, and
    ``plan_rows``' plans for those rows as a static batch and while rows wait)`` per call."""
    import rheoplan.decode as dec

    seen, real = [], dec._rows_plan

    def spy(s, live):
        static, waiting = (s.cost.plan_rows(len(live), ctx=max(r.prefix_len for r in live), max_depth=s.tree.depth,
                                            max_width=min(s.tree.frontier, s.tree.budget), calibration=s.calibration,
                                            rows_waiting=w) for w in (False, True))
        p = real(s, live)
        seen.append((len(live), s.rows_waiting, p, static, waiting))
        return p

    monkeypatch.setattr(dec, "_rows_plan", spy)
    return seen


def test_several_rows_draft_the_plans_tree_for_the_slowest_row_unless_rows_wait(monkeypatch):
    """Several live rows draft the a-priori plan's shape: every row's kept tree is at most
    ``plan.depth`` deep with at most ``plan.budget`` nodes. While prompts wait to join
    (continuous batching) the plan is the average row's; once none wait, the slowest
    row's (``plan_rows(rows_waiting=False)``): a tree that pays for the average row but not
    for the slowest drafts at 3 rows while prompts wait and not in the batch's last steps."""
    from rheoplan.costmodel import CostModel, Timings

    plans = _plans_seen(monkeypatch)
    drafted = []  # (the step's plan, each row's (kept nodes, depth)) of every several-row tree
    import rheoplan.decode as dec

    real_plan_tree = dec.plan_tree

    def plan_tree(*a, **kw):
        t = real_plan_tree(*a, **kw)
        if t.batch > 1:  # this step's _rows_plan ran just before
            lin = t.linear
            drafted.append((plans[-1][2], [(int(lin.n[b]) - 1, int(lin.depth[b, :int(lin.n[b])].max()))
                                           for b in range(t.batch)]))
        return t

    monkeypatch.setattr(dec, "plan_tree", plan_tree)
    # a verify forward of 3 ms at any size, 0.6 ms draft calls and 0.2 ms of bookkeeping:
    # at 3 rows, one level of two children pays about 1.03x for the average row, not for the slowest
    tm = Timings((1, 64), (3.0, 3.0), (3.0, 3.0), 0, 1000, (1, 64), (0.6, 0.6), 0.2, 0.05)
    cal = Calibration()
    for d in range(TREE.depth):
        cal.width_trials[d] = [1000.0] * 3
        cal.width_accepts[d] = [320.0, 370.0, 390.0]
    cost = CostModel(tm, cal)
    tgt, drf = hashed_context_lm(6, seed=1), hashed_context_lm(6, seed=2)
    rs = plan_and_decode(tgt, drf, [[0, 1], [2], [3], [1, 2], [4], [0], [5]],
                         max_new_tokens=[6, 6, 6, 6, 20, 20, 20], seed=3, tree=TREE, cost_model=cost, max_batch_size=3)
    assert [len(r.tokens) for r in rs] == [6, 6, 6, 6, 20, 20, 20]
    for n, w, p, static, waiting in plans:
        want = waiting if w else static
        assert (None if want.depth == 0 else (want.depth, want.width)) == (None if p is None else (p.depth, p.width))
    three = [(w, p, waiting) for n, w, p, _, waiting in plans if n == 3]
    assert any(w and p is not None for w, p, _ in three)  # drafts while prompts wait ...
    assert any(not w and p is None and waiting.depth > 0 for w, p, waiting in three)  # ... not for the slowest row
    assert drafted and all(p is not None for p, _ in drafted)
    for p, sz in drafted:
        assert all(n <= p.budget and (n == 0 or d <= p.depth) for n, d in sz), (p, sz)


# --------------------------------------------------------------------------------------
# Statistics through the real loop
# --------------------------------------------------------------------------------------


def _batched_samples(target, draft, prompts, limits, runs, *, tree, sampling, eos=None, mutations=(),
                     cost_model=None, steps=None, max_batch_size=None):
    """``runs`` batched decodes (seeds SEED0 + r); per row, the emitted tuples. ``steps``
    (a list), if given, receives every row's ``StepStats``."""
    out = [[] for _ in prompts]
    with mutation(*mutations):
        for r in range(runs):
            rs = plan_and_decode(target, draft, prompts, max_new_tokens=limits, sampling=sampling, tree=tree,
                                 seed=SEED0 + r, eos_token_id=eos, cost_model=cost_model,
                                 max_batch_size=max_batch_size)
            for b, res in enumerate(rs):
                out[b].append(tuple(res.tokens))
                if steps is not None:
                    steps += res.steps
    return out


@pytest.mark.parametrize("case", ["tree", "autoregressive", "autoregressive_keep_first_rows",
                                  "autoregressive_shared_root_noise"])
def test_functional_batch_rows_follow_the_target_law(case, record_property):
    """Each row's law is the exact law (``exact_law`` == ``target_law``), and rows 0 and 1 are
    independent (their joint law is the product). Mutation controls: rows leaving the batch
    keep the wrong rows' state (``batch_keep_first_rows``; row 0 stops after two tokens, the
    first served from the prompt's forward, the second from the first batched step);
    the rows drawing together share one row's noise (``batch_shared_root_noise``: every
    row's own law is still exact, only the independence test can see it)."""
    V, runs = 4, 600
    tgt, drf = hashed_context_lm(V, seed=11), hashed_context_lm(V, seed=12, sharpness=0.5)
    s = SamplingConfig()
    cfg = TreeConfig(depth=2, frontier=2, slots=2, budget=4, rheostat=1, support=V)
    prompts, limits = [[0, 1], [2, 3], [1, 0]], [2, 3, 3]
    mutations = {"autoregressive_keep_first_rows": ("batch_keep_first_rows",),
                 "autoregressive_shared_root_noise": ("batch_shared_root_noise",)}.get(case, ())
    draft = drf if case == "tree" else None
    samples = _batched_samples(tgt, draft, prompts, limits, runs, tree=cfg, sampling=s, mutations=mutations)
    pvals = []
    for b, (p, n) in enumerate(zip(prompts, limits)):
        law = target_law(tgt, p, n, s)
        if case == "tree":
            assert total_variation(exact_law(tgt, drf, p, n, tree=cfg, sampling=s), law) < 1e-9
        pvals.append(chi_square(law, samples[b]).pvalue)
    # independence: the pair (row 0's tokens, row 1's first token) against the product law
    l0, l1 = target_law(tgt, prompts[0], limits[0], s), target_law(tgt, prompts[1], 1, s)
    joint = {a + c: pa * pc for a, pa in l0.items() for c, pc in l1.items()}
    pvals.append(chi_square(joint, [x + y[:1] for x, y in zip(samples[0], samples[1])]).pvalue)
    record_property("pvalues", pvals)
    if mutations:
        assert min(pvals) < 1e-6, pvals
    else:
        assert min(pvals) >= ALPHA / len(pvals), pvals


def _hf_batch_law_pvalues(target, prompts, limits, eos, samples, s, mutations) -> list[float]:
    """Per row: chi-square p-values of all its tokens and of its first two against the
    target's own law (a plain full-path forward), truncated at EOS."""
    fn = hf_as_functional(target)
    pvals = []
    for b, (p, n) in enumerate(zip(prompts, limits)):
        # each row's law of all its tokens, and of its first two (fewer cells to pool: the
        # sharper test of the first batched step)
        for k in (n, 2):
            law = _truncate_at_eos(target_law(fn, p, k, s), eos)
            res = chi_square(law, [x[:k] for x in samples[b]])
            if not mutations:
                assert res.unexpected == 0, (b, res)
            pvals.append(res.pvalue)
    return pvals


@pytest.mark.slow
@pytest.mark.no_ir_lint
@pytest.mark.parametrize("mutations, fold", [((), False), ((), True), (("batch_shift_rows",), False)],
                         ids=["exact", "exact-folded", "batch_shift_rows"])
def test_hf_batch_of_4_matches_the_target_law(mutations, fold, record_property, monkeypatch):
    """Batch 4 through HFTarget/HFDraft's batched caches: rows of different prompt lengths,
    EOS (token 5) ends some rows early; each row's law is the target's own (a plain full-path
    forward, ``hf_as_functional``), truncated at EOS. Mutation control: every row attends to
    its neighbour's cache entries (``batch_shift_rows``). ``exact-folded``: the masked
    forwards fold each group's query heads (``gqa_attention.sdpa_fold_forward``) whatever
    this machine measured; ``exact``: they keep ``enable_gqa``."""
    import rheoplan.models.gqa_attention as gqa

    monkeypatch.setattr(gqa, "fold_pays", lambda model, rows: fold)
    # hidden 32 and a scaled head: the neighbour's entries move a row's next-token law by a
    # total variation of up to ~0.2 (about 0.05 with the 16-wide model), which 600 runs detect
    # (the first token of each row comes from the prompts' forward, which has no neighbour's
    # entries to read: only tokens 2 and 3 can show the mutation)
    target, draft = tiny_llama(0, layers=2, hidden=32, head_scale=10.0), tiny_llama(1)
    s = SamplingConfig()
    cfg = TreeConfig(depth=3, frontier=2, slots=2, budget=5, rheostat=1, support=6)
    prompts, limits, eos = [[0, 1], [2], [3, 4, 1, 2], [1, 0, 2]], [3, 3, 3, 3], {5}
    runs = 600
    samples = _batched_samples(target, draft, prompts, limits, runs, tree=cfg, sampling=s, eos=eos,
                               mutations=mutations)
    pvals = _hf_batch_law_pvalues(target, prompts, limits, eos, samples, s, mutations)
    record_property("pvalues", pvals)
    assert any(len(x) < 2 for x in samples[0] + samples[1])  # EOS stopped some rows early
    if mutations:
        assert min(pvals) < 1e-6, pvals
    else:
        assert min(pvals) >= ALPHA / len(pvals), pvals


@pytest.mark.slow
@pytest.mark.no_ir_lint
@pytest.mark.parametrize("case", ["groups", "plan-trees"])
@pytest.mark.parametrize("mutations", [(), ("batch_shift_rows",)], ids=["exact", "batch_shift_rows"])
def test_hf_batch_of_4_with_the_cost_model_matches_the_target_law(mutations, case, record_property, monkeypatch):
    """The same batch of 4 as ``rheoplan generate`` decodes it: with a cost model. Each
    row's law is still the target's own; the mutation control (``batch_shift_rows``) is
    caught through this path too.

    * ``groups``: a verify forward that costs 1 ms per token: the prompts are prefilled in
      length groups (``prefill_groups``: here 2 tokens' worth per forward), several live
      rows take plain steps and one live row drafts the cost passes' trees, on some steps.
    * ``plan-trees``: a nearly flat verify forward and 3 rows at a time (continuous
      batching: the fourth prompt waits): several live rows draft the a-priori plan's tree
      (``_rows_plan``), one shape for every row, calibrated per width as the rows decode."""
    import rheoplan.decode as dec
    from rheoplan.costmodel import CostModel, Timings
    from rheoplan.models.hf_target import HFTarget

    groups = _spy(monkeypatch, HFTarget, "_prefill_groups", lambda ids, with_root, g: g)
    plans = []
    real_plan = dec._rows_plan

    def rows_plan(s, live):
        p = real_plan(s, live)
        plans.append((len(live), p))
        return p

    monkeypatch.setattr(dec, "_rows_plan", rows_plan)
    verify_hi = 65.0 if case == "groups" else 3.0
    tm = Timings((1, 64), (2.0, verify_hi), (2.0, verify_hi), 0, 1000, (1, 64), (0.1, 0.5), 0.05, 0.05)
    target, draft = tiny_llama(0, layers=2, hidden=32, head_scale=10.0), tiny_llama(1)
    s = SamplingConfig()
    cfg = TreeConfig(depth=3, frontier=2, slots=2, budget=5, rheostat=1, support=6)
    prompts, limits, eos = [[0, 1], [2], [3, 4, 1, 2], [1, 0, 2]], [3, 3, 3, 3], {5}
    steps: list = []
    # 1000 runs: with plain steps between the trees the mutant moves fewer tokens than in
    # the test above (600 runs left its smallest p-value at 1.4e-7)
    samples = _batched_samples(target, draft, prompts, limits, 1000, tree=cfg, sampling=s, eos=eos,
                               mutations=mutations, cost_model=CostModel(tm), steps=steps,
                               max_batch_size=None if case == "groups" else 3)
    pvals = _hf_batch_law_pvalues(target, prompts, limits, eos, samples, s, mutations)
    record_property("pvalues", pvals)
    drafted = sum(st.drafted for st in steps if st.predicted_ms)  # (step 0 is served: no tree)
    assert 0 < drafted < sum(1 for st in steps if st.predicted_ms)  # trees on some steps only
    if case == "groups":
        assert groups and all(g is not None and len(g) > 1 for g in groups)  # grouped prefill
        assert plans and not any(p for _, p in plans)  # several rows: plain steps
    else:
        shapes = {(n, p.depth, p.width) for n, p in plans if p is not None}
        assert {n for n, _, _ in shapes} >= {2, 3} and len(shapes) > 1, shapes  # several rows, several shapes
    if mutations:
        assert min(pvals) < 1e-6, pvals
    else:
        assert min(pvals) >= ALPHA / len(pvals), pvals


def test_batch_shift_rows_breaks_greedy_parity(llamas):
    """The mutation control of the greedy tests: mixed-up row masks change the tokens."""
    target, draft = llamas
    with mutation("batch_shift_rows"):
        rs = plan_and_decode(target, draft, PROMPTS, max_new_tokens=LIMITS, sampling=GREEDY, tree=TREE_HF, seed=0)
    assert any(r.tokens != greedy_reference(target, p, n) for p, n, r in zip(PROMPTS, LIMITS, rs))


# --------------------------------------------------------------------------------------
# Bad input: a clear error naming the parameter and the row, before any model work
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompts,kw,err,match", [
    (torch.tensor([[0, 1, 2], [3, 4, 5]]), {}, ValueError, r"attention_mask"),
    ([[0, 1], []], {}, ValueError, r"row 1.*empty"),
    ([[0, 1], [2, 9]], {}, ValueError, r"row 1.*out of range"),
    (torch.tensor([[0.0, 1.0], [2.0, 3.0]]), {"attention_mask": torch.ones(2, 2)}, TypeError, r"dtype"),
    (torch.tensor([[0, 1], [2, 3]]), {"attention_mask": torch.ones(2, 2)}, TypeError, r"attention_mask.*dtype"),
    (torch.tensor([[0, 1], [2, 3]]), {"attention_mask": torch.tensor([[1, 1], [0, 0]])}, ValueError,
     r"row 1 is empty"),
    (torch.tensor([[0, 1, 2], [2, 3, 1]]), {"attention_mask": torch.tensor([[1, 1, 1], [1, 0, 1]])}, ValueError,
     r"attention_mask row 1 has padding between tokens"),
    (torch.tensor([[0, 1], [2, 3]]), {"attention_mask": torch.ones(2, 3, dtype=torch.int64)}, ValueError,
     r"attention_mask has shape"),
    ([[0, 1], [2]], {"attention_mask": [[1, 1], [0, 1]]}, ValueError, r"attention_mask .*list"),
    ([[0, 1], [2]], {"max_new_tokens": [3, 4, 5]}, ValueError, r"max_new_tokens has 3 entries for 2"),
    ([[0, 1], [2]], {"max_new_tokens": [3, 0]}, ValueError, r"max_new_tokens\[1\] \(row 1\)"),
    ([[0, 1], [2]], {"stream_ids": [0, 0]}, ValueError, r"stream_ids repeats 0"),
    ([[0, 1], [2]], {"stream_ids": [0]}, ValueError, r"stream_ids has 1 entries for 2"),
    ([0, 1], {"stream_ids": [3]}, ValueError, r"stream_ids .*one sequence"),
    ([[0, 1], [2, "a"]], {}, TypeError, r"row 1"),
    ([[0, 1], [2]], {"backend": "triton"}, ValueError, r"backend='triton'"),
    ([[0, 1], [2]], {"max_batch_size": 0}, ValueError, r"max_batch_size=0 is out of range"),
    ([0, 1], {"max_batch_size": 2}, ValueError, r"max_batch_size .*one sequence"),
])
def test_bad_batch_input_is_refused_before_any_model_work(prompts, kw, err, match):
    calls = []
    lm = hashed_context_lm(6, seed=1)
    fn = lm.fn
    lm.fn = lambda paths: calls.append(len(paths)) or fn(paths)
    kw = {"max_new_tokens": 4, **kw}
    with pytest.raises(err, match=match):
        plan_and_decode(lm, lm, prompts, tree=TREE, seed=0, **kw)
    assert calls == []


def test_batch_larger_than_memory_is_refused_before_any_model_work(llamas, monkeypatch):
    import rheoplan.decode as decode

    target, draft = llamas
    calls = []
    handle = target.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        monkeypatch.setattr(decode, "_free_memory", lambda device: 64 * 1024)  # 64 KiB free
        with pytest.raises(ValueError, match=r"prompt_ids has 4 rows: the batch needs about .* GiB"):
            plan_and_decode(target, draft, PROMPTS, max_new_tokens=8, tree=TREE_HF, seed=0)
        assert calls == []
        with pytest.raises(ValueError, match=r"max_batch_size=2: the batch needs about"):
            plan_and_decode(target, draft, PROMPTS, max_new_tokens=8, tree=TREE_HF, seed=0, max_batch_size=2)
        assert calls == []
        monkeypatch.setattr(decode, "_free_memory", lambda device: 1 << 40)
        plan_and_decode(target, None, PROMPTS, max_new_tokens=1, seed=0)
    finally:
        handle.remove()


def test_memory_estimate_counts_the_draft(llamas, monkeypatch):
    """The refusal prices the draft's caches too: with free memory between the target's
    estimate and the pair's, the batch with the draft is refused, the draft-free one runs."""
    import rheoplan.decode as decode
    from rheoplan.models import as_draft, as_target

    target, draft = llamas
    width, tree_len = 2 * (9 + 8) + 7, 7  # the widest prompt (9) + 8 new tokens, twice, + a tree of 1 + budget
    tgt, drf = as_target(target), as_draft(draft)
    try:
        t, d = tgt.memory_estimate(4, width, tree_len), drf.memory_estimate(4, width, tree_len)
    finally:
        tgt.close()
    e3 = _eagle3(target)
    assert 0 < e3.memory_estimate(1, width, tree_len) < e3.memory_estimate(4, width, tree_len)
    monkeypatch.setattr(decode, "_free_memory", lambda device: t + d // 2)
    with pytest.raises(ValueError, match=r"prompt_ids has 4 rows: the batch needs about"):
        plan_and_decode(target, draft, PROMPTS, max_new_tokens=8, tree=TREE_HF, seed=0)
    plan_and_decode(target, None, PROMPTS, max_new_tokens=8, seed=0)


def test_rows_report_when_they_joined_and_emitted_their_first_token():
    """``joined_seconds`` / ``first_token_seconds`` / ``seconds`` on the run's clock: with
    one row at a time each row joins when the one before it finished, emits its first token
    after joining and finishes after that; a single sequence joins at 0."""
    lm = hashed_context_lm(vocab_size=6, seed=1)
    rs = plan_and_decode(lm, lm, [[0, 1], [2], [3, 4, 5]], max_new_tokens=[3, 5, 2], tree=TREE, seed=0,
                         max_batch_size=1)
    for prev, r in zip(rs, rs[1:]):
        assert r.joined_seconds >= prev.seconds
    for r in rs:
        assert 0.0 < r.joined_seconds < r.first_token_seconds <= r.seconds
    both = plan_and_decode(lm, lm, [[0, 1], [2]], max_new_tokens=[3, 5], tree=TREE, seed=0)
    assert both[0].joined_seconds == both[1].joined_seconds < min(r.first_token_seconds for r in both)
    one = plan_and_decode(lm, lm, [0, 1], max_new_tokens=4, tree=TREE, seed=0)
    assert one.joined_seconds == 0.0 and 0.0 < one.first_token_seconds <= one.seconds
