"""Plan one draft tree: the entry point that runs the pass pipeline."""

from __future__ import annotations

from typing import Sequence

import torch

from rheoplan.config import SamplingConfig, TreeConfig
from rheoplan.ir import DraftTree, empty_tree
from rheoplan.pipeline import DraftFn, Instrument, PassContext, SamplerFn, run_pipeline
from rheoplan.planner.assign import gumbel_sampler
from rheoplan.planner.default import DEFAULT_PIPELINE
from rheoplan.rng import Streams


def plan_tree(draft: DraftFn, root_tokens: Sequence[int] | torch.Tensor, *,
              tree: TreeConfig, sampling: SamplingConfig, prefix_len=None,
              seed: int = 0, step: int = 0, sampler: SamplerFn | None = None,
              passes: Sequence | None = None, instruments: Sequence[Instrument] = ()) -> DraftTree:
    """Build, prune and linearise ``B = len(root_tokens)`` draft trees.

    ``draft(tree, nodes [B, n]) -> logits [B, n, V]`` is called once per depth.
    ``sampler`` overrides the Gumbel draw of sampled tokens (the oracle injects draws).

    Example:
        >>> import torch
        >>> from rheoplan import TreeConfig, SamplingConfig
        >>> draft = lambda t, nodes: torch.zeros(nodes.shape[0], nodes.shape[1], 8)
        >>> t = plan_tree(draft, [3], tree=TreeConfig(depth=2, frontier=2, slots=2, budget=4, support=8),
        ...               sampling=SamplingConfig())
        >>> int(t.linear.n[0])
        5
    """
    roots = torch.as_tensor(root_tokens, dtype=torch.int64).reshape(-1)
    B = roots.numel()
    if B == 0:
        raise ValueError("root_tokens is empty: need one root token per tree")
    if prefix_len is None:
        prefix_len = torch.zeros(B, dtype=torch.int64)
    prefix_len = torch.as_tensor(prefix_len, dtype=torch.int64).reshape(-1).expand(B)
    m = tree.effective_rheostat(sampling)
    t0 = empty_tree(B, tree.capacity, tree.max_expanded, tree.support, roots, prefix_len, m, tree.slots)
    ctx = PassContext(tree_cfg=tree, sampling=sampling, draft=draft,
                      sampler=sampler or gumbel_sampler(Streams(seed), step), step=step,
                      instruments=list(instruments))
    return run_pipeline(DEFAULT_PIPELINE if passes is None else passes, t0, ctx)
