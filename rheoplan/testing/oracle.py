"""The exact oracle (docs/method.md §7.1): the law of the first ``n`` emitted tokens
of the whole multi-step decode, computed by enumeration.

Every source of randomness is branched over with its exact probability:

* draft draws: each sampled slot's ``Y`` takes every tail index with probability
  ``q~`` (injected through the planner's ``sampler`` hook; the pass list is forked at
  every ``assign`` pass, so deeper levels see the draws of the shallower ones);
* verification: at every node the walk reaches, every ``X`` with nonzero probability
  under ``rheoplan.verify.coupling_law`` (or ``p`` at an unexpanded node);
* later steps: the last emitted token becomes the next root, the context grows, and the
  enumeration recurses until ``n`` tokens exist.

The planner passes and the couplings are the production ones (``DEFAULT_PIPELINE``,
``rheoplan.verify``); only the random numbers are replaced by enumeration. The result
should equal ``target_law`` (the target's own product law) to float64 rounding.

Example:
    >>> from rheoplan.models.functional import hashed_context_lm
    >>> from rheoplan import TreeConfig, SamplingConfig
    >>> tgt, drf = hashed_context_lm(4, seed=1), hashed_context_lm(4, seed=2)
    >>> cfg = TreeConfig(depth=2, frontier=1, slots=2, budget=3, rheostat=1, support=4)
    >>> law = exact_law(tgt, drf, (0,), 2, tree=cfg, sampling=SamplingConfig())
    >>> total_variation(law, target_law(tgt, (0,), 2, SamplingConfig())) < 1e-12
    True
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from typing import Sequence

import torch

from rheoplan.backends import resolve_backend
from rheoplan.config import SamplingConfig, TreeConfig
from rheoplan.distributions import tail_law, target_probs
from rheoplan.ir import DraftTree, empty_tree
from rheoplan.pipeline import PassContext, flatten, lower
from rheoplan.planner.default import DEFAULT_PIPELINE, cost_pipeline
from rheoplan.verify import kept_children, node_law, node_y

Law = dict[tuple[int, ...], float]


def total_variation(a: Law, b: Law) -> float:
    """``0.5 * sum |a - b|`` over the union of outcomes.

    Example:
        >>> total_variation({(0,): 0.5, (1,): 0.5}, {(0,): 1.0})
        0.5
    """
    keys = set(a) | set(b)
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in keys)


class _TargetMemo:
    """Processed target law per full path, memoised (the oracle revisits paths often).
    The path is the context the law's logits processors see (``generate``'s input_ids)."""

    def __init__(self, target, sampling: SamplingConfig, processors: Sequence = ()):
        self.target, self.sampling, self.processors = target, sampling, tuple(processors)
        self.memo: dict[tuple[int, ...], torch.Tensor] = {}

    def __call__(self, path: tuple[int, ...]) -> torch.Tensor:
        p = self.memo.get(path)
        if p is None:
            p = target_probs(self.target([path])[0], self.sampling, path, self.processors)
            self.memo[path] = p
        return p


def target_law(target, prefix: Sequence[int], n_tokens: int, sampling: SamplingConfig = SamplingConfig(),
               processors: Sequence = ()) -> Law:
    """The target's exact law of its next ``n_tokens`` tokens after ``prefix`` (plain
    autoregressive sampling from the processed distribution ``p``; ``processors`` as in
    ``plan_and_decode(logits_processors=...)``).

    Example:
        >>> import torch
        >>> from rheoplan.models.functional import FunctionalLM
        >>> lm = FunctionalLM(lambda paths: torch.tensor([[0., 0.]] * len(paths)), 2)
        >>> target_law(lm, (0,), 2)
        {(0, 0): 0.25, (0, 1): 0.25, (1, 0): 0.25, (1, 1): 0.25}
    """
    _check_args(prefix, n_tokens)
    probs = _TargetMemo(target, sampling, processors)
    out: Law = {}

    def rec(ctx: tuple[int, ...], acc: tuple[int, ...], w: float) -> None:
        if len(acc) == n_tokens:
            out[acc] = out.get(acc, 0.0) + w
            return
        p = probs(ctx)
        for x in torch.nonzero(p > 0).flatten().tolist():
            rec(ctx + (x,), acc + (x,), w * float(p[x]))

    rec(tuple(int(t) for t in prefix), (), 1.0)
    return out


def _check_args(prefix, n_tokens) -> None:
    if len(prefix) == 0:
        raise ValueError("prefix is empty: it must end with the first root token")
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 1:
        raise ValueError(f"n_tokens={n_tokens!r} is out of range: allowed int >= 1")


def functional_draft_fn(draft, context: Sequence[int]):
    """The planner's ``draft(tree, nodes) -> logits`` callback for a functional model: the
    logits at node ``v`` of tree ``b`` are ``draft(context + path_tokens(b, v))``, where
    ``context`` ends with the root token (one shared context for every tree ``b``)."""
    ctx = tuple(int(t) for t in context)
    return functional_draft_fn_batch(draft, [ctx])


def functional_draft_fn_batch(draft, contexts: Sequence[Sequence[int]]):
    """Like ``functional_draft_fn`` with one context per tree (``contexts[b]``; a single
    context is shared by all trees)."""
    ctxs = [tuple(int(t) for t in c) for c in contexts]

    def fn(tree: DraftTree, nodes: torch.Tensor) -> torch.Tensor:
        B, n = nodes.shape
        paths, where = [], []
        for b in range(B):
            ctx = ctxs[b] if len(ctxs) > 1 else ctxs[0]
            for j in range(n):
                v = int(nodes[b, j])
                if v >= 0:
                    paths.append(ctx + tuple(tree.path_tokens(b, v)))
                    where.append((b, j))
        rows = draft(paths)
        out = torch.zeros(B, n, rows.shape[-1], dtype=torch.float32)
        for (b, j), r in zip(where, rows):
            out[b, j] = r
        return out

    return fn


def enumerate_trees(draft, context: Sequence[int], tree: TreeConfig, sampling: SamplingConfig,
                    passes=None, backend: str = "reference"):
    """Yield ``(probability, DraftTree)`` for every realisation of the draft draws of one
    step whose root is ``context[-1]`` (probabilities sum to 1).

    The pass list is run in order and forked at each ``assign`` pass: a probe run records
    the tail laws ``q~`` it would draw from, then one branch per joint choice of tail
    indices (with nonzero probability) continues with the remaining passes. The list is
    lowered to ``backend`` (a concrete one: 'reference', 'numba' or 'triton').
    """
    ctx_tokens = tuple(int(t) for t in context)
    m = tree.effective_rheostat(sampling)
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    t0 = empty_tree(1, tree.capacity, tree.max_expanded, tree.support,
                    torch.tensor([ctx_tokens[-1]]), torch.tensor([len(ctx_tokens) - 1]), m, tree.slots,
                    device=device)
    ctx = PassContext(tree_cfg=tree, sampling=sampling, draft=functional_draft_fn(draft, ctx_tokens),
                      sampler=None, step=0)
    plist = flatten(lower(DEFAULT_PIPELINE if passes is None else passes, backend), ctx)

    def rec(k: int, t: DraftTree, w: float):
        if k == len(plist):
            yield w, t
            return
        name, p = plist[k]
        if not name.split("@")[0] == "assign":
            yield from rec(k + 1, p(t, ctx), w)
            return
        draws: list[torch.Tensor] = []

        def probe(b, node, qt):
            draws.append(qt)
            return int(torch.nonzero(qt > 0).flatten()[0]) if bool((qt > 0).any()) else 0

        ctx.sampler = probe
        p(t, ctx)
        options = [[(i, float(qt[i])) for i in torch.nonzero(qt > 0).flatten().tolist()] for qt in draws]
        for combo in itertools.product(*options):
            it = iter(combo)
            ctx.sampler = lambda b, node, qt: next(it)[0]
            wc = w
            for _, pr in combo:
                wc *= pr
            yield from rec(k + 1, p(t, ctx), wc)

    yield from rec(0, t0, 1.0)


def verify_law(t: DraftTree, context: Sequence[int], probs, verifier: str,
               b: int = 0, coupling=None) -> Law:
    """Exact law of the emitted tokens of one verification walk over tree ``b``.

    ``probs(path) -> p`` gives the processed target law at a full token path;
    ``context`` ends with the root token. ``coupling``, if given, replaces
    ``rheoplan.verify.coupling_law`` at expanded nodes (see ``exact_law``).
    """
    lin = t.linear
    out: Law = defaultdict(float)
    ctx = tuple(int(x) for x in context)

    def rec(i: int, path: tuple[int, ...], emitted: tuple[int, ...], w: float) -> None:
        p = probs(path)
        row = int(lin.exp_row[b, i])
        if row < 0:
            law = p
        elif coupling is None:
            law = node_law(t, b, row, p, verifier)
        else:
            law = coupling(p, t.sup_token[b, row], t.sup_q[b, row], int(t.sup_n[b, row]), t.rheostat,
                           t.slots, node_y(t, b, row)).to(torch.float64)
        kids = kept_children(t, b, i)
        for x in torch.nonzero(law > 0).flatten().tolist():
            wx = w * float(law[x])
            c = kids.get(x)
            if c is None:
                out[emitted + (x,)] += wx
            else:
                rec(c, path + (x,), emitted + (x,), wx)

    rec(0, ctx, (), 1.0)
    return dict(out)


class ExactOracle:
    """Memoised enumeration of the decode law for fixed models and configs.

    ``step_law(context)`` is the law of one step's emitted tokens (accepted drafts then the
    extra token); ``law(context, n)`` the law of the first ``n`` tokens of the decode.
    """

    def __init__(self, target, draft, tree: TreeConfig, sampling: SamplingConfig,
                 coupling=None, passes=None, processors: Sequence = (), backend: str = "auto"):
        self.backend = resolve_backend(backend, "cuda" if backend == "triton" and torch.cuda.is_available()
                                       else "cpu")
        self.target, self.draft, self.tree, self.sampling = target, draft, tree, sampling
        self.coupling = coupling
        self.passes = passes
        self.probs = _TargetMemo(target, sampling, processors)
        self._step: dict[tuple[int, ...], Law] = {}
        self._law: dict[tuple[tuple[int, ...], int], Law] = {}
        self.n_trees = 0  #: tree realisations enumerated so far

    def step_law(self, context: Sequence[int]) -> Law:
        ctx = tuple(int(t) for t in context)
        got = self._step.get(ctx)
        if got is None:
            got = defaultdict(float)
            for w, t in enumerate_trees(self.draft, ctx, self.tree, self.sampling, passes=self.passes,
                                        backend=self.backend):
                self.n_trees += 1
                t = t.to("cpu")  # the enumeration reads it on the host
                for seq, pv in verify_law(t, ctx, self.probs, self.tree.verifier,
                                           coupling=self.coupling).items():
                    got[seq] += w * pv
            got = dict(got)
            self._step[ctx] = got
        return got

    def law(self, context: Sequence[int], n_tokens: int) -> Law:
        _check_args(context, n_tokens)
        ctx = tuple(int(t) for t in context)
        key = (ctx, n_tokens)
        got = self._law.get(key)
        if got is None:
            acc: Law = defaultdict(float)
            for seq, w in self.step_law(ctx).items():
                if len(seq) >= n_tokens:
                    acc[seq[:n_tokens]] += w
                else:
                    for rest, w2 in self.law(ctx + seq, n_tokens - len(seq)).items():
                        acc[seq + rest] += w * w2
            got = dict(acc)
            self._law[key] = got
        return got


def exact_law(target, draft, prefix: Sequence[int], n_tokens: int, *,
              tree: TreeConfig = TreeConfig(depth=2, frontier=2, slots=2, budget=4, rheostat=1, support=8),
              sampling: SamplingConfig = SamplingConfig(),
              coupling=None, passes=None, processors: Sequence = (), cost_plan=None,
              backend: str = "auto") -> Law:
    """Exact law of the first ``n_tokens`` tokens emitted by the whole multi-step decode.

    Args:
        target, draft: functional models (``rheoplan.models.functional.FunctionalLM`` or any
            callable ``paths -> logits [len(paths), V]``), pure functions of the full path.
        prefix: the prompt; its last token is the first root.
        n_tokens: how many emitted tokens to keep (later ones are truncated away).
        tree, sampling: the decode configuration (``tree.verifier`` picks the coupling).
        coupling: a verifier of your own, replacing ``tree.verifier`` at expanded nodes:
            ``coupling(p, sup_token, sup_q, sup_n, m, K, y_token) -> law of X [V]`` with the
            arguments of ``rheoplan.verify.coupling_law`` (``y_token`` = -1: no sampled slot).
            The walk still moves to the kept child whose token is ``X``.
        passes: a pass list of your own instead of ``DEFAULT_PIPELINE`` (see
            ``examples/custom_pass.py``); sampled tokens are forked at every pass named
            ``assign@d``.
        processors: logits processors of the target law (``plan_and_decode``'s
            ``logits_processors``); each sees the full path as its input ids.
        cost_plan: a frozen ``rheoplan.costmodel.CostPlan`` (timings + calibration): the
            pass list is made cost-aware (``rheoplan.planner.default.cost_pipeline``), so
            the law covers the cost-aware depth gate and prune with that calibration.
        backend: which implementation of the built-in passes plans the trees ('auto',
            'reference', 'numba', 'triton'; ``rheoplan.backends``); the oracle then proves
            the lowered pipeline lossless, not only the reference passes.

    Returns ``{tokens: probability}``; compare with ``target_law`` by ``total_variation``.
    Cost grows like (tail size) ** (expanded nodes) per step: keep vocabularies at 3-6
    tokens, depth <= 3, frontier <= 2.
    """
    if cost_plan is not None:
        passes = cost_pipeline(cost_plan, passes)
    return ExactOracle(target, draft, tree, sampling, coupling, passes, processors, backend).law(prefix, n_tokens)


def coupling_marginal_error(coupling, p: torch.Tensor, sup_token: torch.Tensor, sup_q: torch.Tensor,
                            sup_n: int, m: int, K: int) -> float:
    """Max-norm distance between ``p`` and the ``X``-marginal of ``coupling`` at one node,
    averaging its law over every ``Y`` of the tail law ``q~`` (0 for a lossless coupling).

    Example:
        >>> from rheoplan.verify import coupling_law
        >>> rheo = lambda *a: coupling_law(*a, "rheo")
        >>> p = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
        >>> coupling_marginal_error(rheo, p, torch.tensor([0, 1, 2]), torch.tensor([0.5, 0.3, 0.2]), 3, 1, 2) < 1e-12
        True
    """
    p = p.to(torch.float64)
    if m >= K:
        return float((coupling(p, sup_token, sup_q, sup_n, m, K, -1).to(torch.float64) - p).abs().max())
    qt = tail_law(sup_q, m, int(sup_n))
    mix = torch.zeros_like(p)
    for i in range(int(sup_n) - m):
        if float(qt[i]) > 0:
            mix += float(qt[i]) * coupling(p, sup_token, sup_q, sup_n, m, K, int(sup_token[m + i])).to(torch.float64)
    return float((mix - p).abs().max())
