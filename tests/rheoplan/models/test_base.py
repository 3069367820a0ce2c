"""The adapter interfaces (``rheoplan.models.base``): every member the decode loop calls
is declared, with defaults where an adapter may not need it, and the loop works with a
custom adapter that overrides only the abstract methods."""

from __future__ import annotations

import ast
import inspect

import pytest

import rheoplan.decode
from rheoplan import TreeConfig, plan_and_decode
from rheoplan.models import DraftModel, FunctionalDraft, FunctionalTarget, TargetModel, TreeLogits, hashed_context_lm


class _MinimalTarget(TargetModel):
    """Only the abstract methods: a FunctionalTarget by delegation."""

    def __init__(self, lm):
        self._inner = FunctionalTarget(lm)
        self.vocab_size = lm.vocab_size

    def start(self, prompt_ids):
        self._inner.start(prompt_ids)

    def forward_tree(self, linear):
        inner = self._inner.forward_tree(linear)

        class _Logits(TreeLogits):
            def logits(self, i):
                return inner.logits(i)

        return _Logits()

    def commit(self, path):
        self._inner.commit(path)


class _MinimalDraft(DraftModel):
    def __init__(self, lm):
        self._inner = FunctionalDraft(lm)
        self.vocab_size = lm.vocab_size

    def start(self, prompt_ids):
        self._inner.start(prompt_ids)

    def node_logits(self, tree, nodes):
        return self._inner.node_logits(tree, nodes)

    def commit(self, tree, path_nodes, emitted, features):
        self._inner.commit(tree, path_nodes, emitted, features)


def test_minimal_adapters_decode_like_the_builtin_ones(monkeypatch):
    """A target without ``start_and_root`` verifies the last prompt token at step 0: the
    builtin functional target does the same once its ``start_and_root`` is taken away;
    with it, step 0 is served from the prompt and the tokens differ (the same law)."""
    tgt, drf = hashed_context_lm(6, seed=1), hashed_context_lm(6, seed=2)
    cfg = TreeConfig(depth=2, frontier=2, slots=2, budget=4, support=6)
    got = plan_and_decode(_MinimalTarget(tgt), _MinimalDraft(drf), [0, 1], max_new_tokens=8, tree=cfg, seed=5)
    served = plan_and_decode(tgt, drf, [0, 1], max_new_tokens=8, tree=cfg, seed=5)
    assert served.steps[0].tree_size == 0 and got.steps[0].tree_size > 0
    monkeypatch.setattr(FunctionalTarget, "start_and_root", TargetModel.start_and_root)
    ref = plan_and_decode(tgt, drf, [0, 1], max_new_tokens=8, tree=cfg, seed=5)
    assert got.tokens == ref.tokens
    assert [s.accepted for s in got.steps] == [s.accepted for s in ref.steps]


def test_defaults():
    t, d = _MinimalTarget(hashed_context_lm(4)), _MinimalDraft(hashed_context_lm(4))
    assert t.device is None and t.max_context is None and d.device is None
    assert t.prompt_features_for(object()) is None
    assert t.close() is None and d.close() is None
    assert d.check_vocab_map(4) is None and d.take_prompt_features(t) is None


def test_an_adapter_missing_an_abstract_method_cannot_be_built():
    class NoCommit(TargetModel):
        vocab_size = 4

        def start(self, prompt_ids): ...

        def forward_tree(self, linear): ...

    with pytest.raises(TypeError, match="commit"):
        NoCommit()


def test_the_loop_probes_no_adapter_attribute():
    """The loop calls declared members only: no getattr / hasattr on models in decode.py."""
    tree = ast.parse(inspect.getsource(rheoplan.decode))
    probes = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
              and n.func.id in ("getattr", "hasattr")]
    # _check_prompt / _check_eos test user input for __iter__; phase_totals reads StepStats.
    allowed = {"__iter__"}
    for call in probes:
        name = call.args[1]
        user_input = isinstance(name, ast.Constant) and name.value in allowed
        step_stats = ast.unparse(call) == "getattr(s, k)"
        assert user_input or step_stats, ast.unparse(call)


def test_every_member_the_loop_calls_is_declared():
    declared_t = {n for n in dir(TargetModel) if not n.startswith("__")} | {"vocab_size"}
    declared_d = {n for n in dir(DraftModel) if not n.startswith("__")} | {"vocab_size"}
    src = inspect.getsource(rheoplan.decode)
    tree = ast.parse(src)
    used_t = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
              and isinstance(n.value, ast.Name) and n.value.id == "tgt"}
    used_d = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
              and isinstance(n.value, ast.Name) and n.value.id == "drf"}
    assert used_t and used_d
    assert used_t <= declared_t, used_t - declared_t
    assert used_d <= declared_d, used_d - declared_d
    assert {"logits", "features", "prefetch"} <= {n for n in dir(TreeLogits) if not n.startswith("__")}


def test_batched_host_reads_equal_the_per_row_reads():
    """``linears_on_host`` / ``drafts_on_host`` (one transfer for every row, what the
    batched commits read) give each row what ``linear_on_host`` / ``draft_on_host`` give,
    on trees of different sizes (rows padded to the widest)."""
    import dataclasses

    import torch

    from rheoplan import SamplingConfig, plan_tree
    from rheoplan.models.base import draft_on_host, drafts_on_host, linear_on_host, linears_on_host
    from tests._planner_helpers import PathDraft

    g = torch.Generator().manual_seed(5)
    draft = PathDraft(torch.randn(7, 12, generator=g).tolist())
    tree = plan_tree(draft, [3, 5, 7], tree=TreeConfig(depth=3, frontier=2, slots=2, rheostat=1, budget=5),
                     sampling=SamplingConfig(temperature=1.0), prefix_len=[4, 9, 2], seed=1, step=0)
    # rows of different sizes, as a batch holds (a root-only row among them)
    lin = dataclasses.replace(tree.linear, n=torch.tensor([6, 1, 4]))
    tree = tree.replace(n_nodes=torch.tensor([11, 1, 7]), linear=lin)
    hosts = linears_on_host(lin)
    assert hosts == [linear_on_host(lin, b) for b in range(tree.batch)]
    assert [h.n for h in hosts] == [6, 1, 4] and len(hosts[2].token) == 4
    drafts = drafts_on_host(tree)
    assert drafts == [draft_on_host(tree, [], b) for b in range(tree.batch)]
    assert [len(d.parent) for d in drafts] == [11, 1, 7]


def test_a_device_step_path_is_checked_without_reading_the_tree():
    from rheoplan.models.base import check_device_path

    assert check_device_path([0, 3, 5], [11, 12, 13]) == [0, 3, 5]
    for path, emitted in (([], [1]), ([2, 3], [1, 2]), ([0, 1], [7])):
        with pytest.raises(ValueError, match="must start with the root"):
            check_device_path(path, emitted)
