"""What one decode step on the Triton backend costs the host (issue 11): the step stays
on the device, so the host syncs a constant number of times per step (at most 3; the
loop makes 2: the deferred draft check at the end of planning, and the walk's tokens),
and the Triton launches of a step are the planner's, the noise's and the walk's.

Counted with ``rheoplan.testing.device`` (see there how a sync is counted on the CPU:
explicit conversions, since the interpreter has no device). The models here are
device-clean on purpose (a bigram table gathered by token tensors, no host reads), so
the count is the decode loop's own. The HF and functional targets read their tree once
per verify (a step stays at 3); the functional draft, a host function of token paths,
once per call and per commit; the EAGLE-3 and HF drafts add none (the last tests here)."""

from __future__ import annotations

import pytest
import torch

from rheoplan import SamplingConfig, TreeConfig
from rheoplan.decode import plan_and_decode, root_only_rows
from rheoplan.models.base import DraftModel, TargetModel, TreeLogits
from rheoplan.testing.device import count_host_syncs, count_triton_launches

V = 24


def _table(seed: int) -> torch.Tensor:
    return torch.randn(V, V, generator=torch.Generator().manual_seed(seed)) * 2.0


class _TableLogits(TreeLogits):
    def __init__(self, table, tokens):
        self._table, self._tokens = table, tokens

    def logits(self, i: int) -> torch.Tensor:
        return self._table[self._tokens[i]]

    def all_logits(self) -> torch.Tensor:
        return self._table[self._tokens]  # every linear slot (padding rows are never read)


class BigramTarget(TargetModel):
    """Next-token logits = a row of a fixed table picked by the current token, on tensors."""

    vocab_size = V

    def __init__(self, seed=0):
        self.table = _table(seed)

    def start(self, prompt_ids):
        pass

    def forward_tree(self, linear):
        return _TableLogits(self.table, linear.token[0])

    def commit(self, path):
        pass


class BigramDraft(DraftModel):
    vocab_size = V

    def __init__(self, seed=1):
        self.table = _table(seed)
        self.calls: list[tuple[int, torch.device]] = []  #: (nodes in the call, their device)

    def start(self, prompt_ids):
        pass

    def node_logits(self, tree, nodes):
        self.calls.append((len(nodes), nodes.device if isinstance(nodes, torch.Tensor) else None))
        nodes = torch.as_tensor(nodes, dtype=torch.int64, device=tree.token.device)
        return self.table[tree.token[0, nodes]]  # one batched call per depth, on the tree's device

    def commit(self, tree, path_nodes, emitted, features):
        pass


def _count_calls(obj, *names: str) -> dict[str, int]:
    """Wrap methods ``names`` of ``obj`` to count their calls; returns the live counts."""
    calls = {name: 0 for name in names}
    for name in names:
        real = getattr(obj, name)

        def counted(*a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*a, **kw)

        setattr(obj, name, counted)
    return calls


@pytest.mark.interpreter
@pytest.mark.no_ir_lint  # the test suite's lint-after-every-pass reads the IR on the host
@pytest.mark.parametrize("verifier,m,T", [("ot", 1, 1.0), ("rheo", 0, 1.0), ("onehot", 2, 0.0)])
def test_triton_step_syncs_and_launches(verifier, m, T):
    D = 3
    cfg = TreeConfig(depth=D, frontier=2, slots=3, budget=6, rheostat=m, support=8, verifier=verifier)
    s = SamplingConfig(temperature=T)
    draft = BigramDraft()
    with count_host_syncs() as syncs, count_triton_launches() as launches:
        res = plan_and_decode(BigramTarget(), draft, [0, 1, 2], max_new_tokens=6, tree=cfg,
                              sampling=s, seed=4, backend="triton")
    n = len(res.steps)
    # the draft: one batched call per depth, node ids as a tensor on the target's device
    assert [c for c, _ in draft.calls] == [1, 2, 2] * n
    assert {d for _, d in draft.calls} == {torch.device("cpu")}
    # a constant per step, not a function of the tree: planning (1) + walk (1)
    assert syncs.count == 2 * n, syncs.where
    k = launches.by_kernel
    # per depth: frontier top-k, slot expansion (expand), Philox noise (assign: none when m = K)
    # then prune top-k, linearize, and the walk's kernels (its noise drawn inside them)
    draws = D if cfg.effective_rheostat(s) < cfg.slots else 0  # greedy: m = K, nothing drawn
    assert k["topk_kernel"] == n * (D + 1)
    assert k["slot_expansion_kernel"] == n * D
    assert k["linearize_kernel"] == n
    # the walk: every node's draw in parallel (the proposal laws and the mass pass only where a
    # proposal is tested),
    # then the walk over the per-node table
    tests = verifier != "onehot" and cfg.effective_rheostat(s) < cfg.slots
    assert k["support_law_kernel"] == k["node_mass_kernel"] == (n if tests else 0)
    assert k["node_draw_kernel"] == n
    assert k["walk_kernel"] == n
    assert k["streams_uniform_kernel"] == n * draws  # the walk draws its noise in-kernel
    assert launches.total == sum(k.values())
    # the same tokens as the reference backend
    ref = plan_and_decode(BigramTarget(), BigramDraft(), [0, 1, 2], max_new_tokens=6, tree=cfg, sampling=s,
                          seed=4, backend="reference")
    assert res.tokens == ref.tokens


def test_sync_counter_sees_host_reads():
    """The counter can fail: a host read in the step is counted."""
    with count_host_syncs() as syncs:
        x = torch.arange(4)
        int(x[1]), x.tolist(), bool(x.any()), float(x.sum()), x.numpy(), x.cpu()
    assert syncs.count == 6


class _FeatureBigramLogits(_TableLogits):
    def __init__(self, table, feats, tokens):
        super().__init__(table, tokens)
        self._feats = feats

    def features(self, i: int) -> torch.Tensor:
        return self._feats.index_select(0, self._tokens[i:i + 1])[0]  # a gather: no host read


class FeatureBigramTarget(BigramTarget):
    """``BigramTarget`` with EAGLE-3 features (a row of a fixed table per token), on tensors."""

    def __init__(self, width, seed=0):
        super().__init__(seed)
        self.feats = torch.randn(V, width, generator=torch.Generator().manual_seed(seed + 10))
        self.prompt: torch.Tensor | None = None

    def start(self, prompt_ids):
        self.prompt = torch.tensor(prompt_ids)

    def prompt_features(self):
        return self.feats[self.prompt[1:]]

    def forward_tree(self, linear):
        return _FeatureBigramLogits(self.table, self.feats, linear.token[0])


def _eagle3_head(draft_vocab):
    from rheoplan.models.eagle3 import Eagle3Config, Eagle3Head

    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config(vocab_size=V, draft_vocab_size=draft_vocab, hidden_size=16,
                                   intermediate_size=32, num_attention_heads=2, num_key_value_heads=1))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.5)
        if draft_vocab < V:
            head.set_vocab_map(torch.randperm(V)[:draft_vocab].sort().values)
    return head.eval()


def _adapter_cfg():
    return TreeConfig(depth=3, frontier=2, slots=3, budget=6, rheostat=1, support=8, verifier="ot")


@pytest.mark.interpreter
@pytest.mark.no_ir_lint
def test_triton_step_syncs_hf_target():
    """A transformers target (``HFTarget``, built by the decode with the Triton tree attention)
    reads its tree on the host once per verify forward (the node count that shapes the
    forward, the checks before model work, the parents that commit checks): with a
    device-clean draft a step makes 3 syncs, the readiness bound."""
    from _decode_models import tiny_llama

    s = SamplingConfig(temperature=1.0)
    # the one-node tree of step 0 is linearised on the host once per process and batch size
    # (no device sync on a GPU, but int() calls the CPU counter sees): made before counting,
    # so the count does not depend on whether an earlier test in the process made it
    root_only_rows([0], [3], _adapter_cfg())
    with count_host_syncs() as syncs, count_triton_launches() as launches:
        res = plan_and_decode(tiny_llama(3, vocab=V, layers=2), BigramDraft(), [0, 1, 2], max_new_tokens=5,
                              tree=_adapter_cfg(), sampling=s, seed=4, backend="triton")
    n = len(res.steps) - 1  # verified steps (step 0 is served by the prompt's forward: one read)
    assert syncs.count == 3 * n + 1, syncs.where
    assert launches.by_kernel["tree_attention_kernel"] == 2 * n  # one per layer per verify
    ref = plan_and_decode(tiny_llama(3, vocab=V, layers=2), BigramDraft(), [0, 1, 2], max_new_tokens=5,
                          tree=_adapter_cfg(), sampling=s, seed=4, backend="reference")
    assert res.tokens == ref.tokens


@pytest.mark.interpreter
@pytest.mark.no_ir_lint
def test_triton_step_syncs_functional_adapters():
    """The functional adapters' models are host functions of token paths, so they read the
    tree on the host, but in one transfer per call: the target once per verify (a step
    stays at 3 syncs with a device-clean draft), the draft once per ``node_logits`` call
    (one per depth) and once per ``commit``."""
    from rheoplan.models.functional import FunctionalDraft, FunctionalTarget, hashed_context_lm

    s = SamplingConfig(temperature=1.0)
    tgt = lambda: FunctionalTarget(hashed_context_lm(V, seed=31, sharpness=1.5))  # noqa: E731
    with count_host_syncs() as syncs:
        res = plan_and_decode(tgt(), BigramDraft(), [0, 1, 2], max_new_tokens=6, tree=_adapter_cfg(), sampling=s,
                              seed=4, backend="triton")
    # step 0 is served by the prompt: no verify forward, one read (its drawn token)
    assert syncs.count == 3 * (len(res.steps) - 1) + 1, syncs.where

    draft = FunctionalDraft(hashed_context_lm(V, seed=32, sharpness=1.5))
    calls = _count_calls(draft, "node_logits", "commit")
    with count_host_syncs() as syncs:
        res = plan_and_decode(tgt(), draft, [0, 1, 2], max_new_tokens=6, tree=_adapter_cfg(), sampling=s, seed=4,
                              backend="triton")
    n = len(res.steps) - 1  # step 0 is served by the prompt (no tree, no draft call)
    assert calls["node_logits"] == 3 * n  # the root, then one call per depth
    assert syncs.count == 3 * n + 1 + calls["node_logits"] + calls["commit"], syncs.where
    ref = plan_and_decode(tgt(), FunctionalDraft(hashed_context_lm(V, seed=32, sharpness=1.5)), [0, 1, 2],
                          max_new_tokens=6, tree=_adapter_cfg(), sampling=s, seed=4, backend="reference")
    assert res.tokens == ref.tokens


@pytest.mark.interpreter
@pytest.mark.no_ir_lint
@pytest.mark.parametrize("draft_vocab", [V, 16])
def test_eagle3_draft_adds_no_host_sync(draft_vocab):
    """The EAGLE-3 adapter on the device path: node ids arrive as a tensor, the attention
    mask, positions, tokens and parents' hiddens are gathered on the device, and commit reads
    nothing back, so a decode step still syncs twice (the loop's own). Per decode, not per
    step: the vocabulary map's checks before the loop (a reduced draft vocabulary only).
    The tokens equal the host path's (reference backend)."""
    from rheoplan.models.eagle3 import Eagle3Draft

    cfg = TreeConfig(depth=3, frontier=2, slots=3, budget=6, rheostat=1, support=8, verifier="ot")
    embed = torch.randn(V, 16, generator=torch.Generator().manual_seed(3))

    def decode(backend, tokens):
        target = FeatureBigramTarget(width=48)
        draft = Eagle3Draft(_eagle3_head(draft_vocab), embed, features_from=target)
        with count_host_syncs() as syncs:
            res = plan_and_decode(target, draft, [0, 1, 2], max_new_tokens=tokens, tree=cfg, seed=4,
                                  backend=backend)
        return res, syncs

    short, s_short = decode("triton", 3)
    res, syncs = decode("triton", 12)
    n = len(res.steps)
    assert n > len(short.steps)
    # per step: the loop's two; per decode: a constant (<= 3, the vocabulary checks)
    per_decode = syncs.count - 2 * n
    assert s_short.count - 2 * len(short.steps) == per_decode, (syncs.where, s_short.where)
    assert per_decode == (0 if draft_vocab == V else 3), syncs.where[:4]
    assert res.tokens == decode("reference", 12)[0].tokens


@pytest.mark.slow  # ~35 s: five interpreted decodes
@pytest.mark.interpreter
@pytest.mark.no_ir_lint
def test_hf_draft_adds_no_host_sync():
    """A transformers draft (``HFDraft``) on the device path: node ids arrive as a tensor, its
    tokens, depths, parents and attention mask are gathered on the device, and commit keeps
    the path's cache entries by device-side columns, so it adds no host sync: a step makes
    the loop's 2, whatever the tree's size (the node-by-node reads it replaced made about
    35 more per step here). Same tokens as the host path (reference backend)."""
    from _decode_models import tiny_llama

    from rheoplan.models.hf_draft import HFDraft

    s = SamplingConfig(temperature=1.0)

    def decode(backend, cfg):
        draft = HFDraft(tiny_llama(5, vocab=V, layers=2))
        calls = _count_calls(draft, "node_logits", "commit")
        with count_host_syncs() as syncs:
            res = plan_and_decode(BigramTarget(), draft, [0, 1, 2], max_new_tokens=8, tree=cfg, sampling=s,
                                  seed=4, backend=backend)
        return res, syncs, calls

    for cfg in (_adapter_cfg(), TreeConfig(depth=4, frontier=4, slots=3, budget=12, rheostat=1, support=8,
                                           verifier="ot")):
        res, syncs, calls = decode("triton", cfg)
        n = len(res.steps)
        assert calls["node_logits"] == cfg.depth * n  # the root, then one call per depth
        assert calls["commit"] >= n - 1  # (the last step's commit is skipped when the decode ends)
        assert syncs.count == 2 * n, syncs.where
        assert res.tokens == decode("reference", cfg)[0].tokens
    # a transformers target and draft (the GPU run's `self` rows): the target's one read per
    # verify, nothing from the draft: the readiness bound of 3
    with count_host_syncs() as syncs:
        res = plan_and_decode(tiny_llama(3, vocab=V, layers=2), HFDraft(tiny_llama(5, vocab=V, layers=2)), [0, 1, 2],
                              max_new_tokens=6, tree=_adapter_cfg(), sampling=s, seed=4, backend="triton")
    assert syncs.count == 3 * (len(res.steps) - 1) + 1, syncs.where  # step 0: served, one read
