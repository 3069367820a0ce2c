"""Plan one draft tree: the entry point that runs the pass pipeline."""

from __future__ import annotations

from typing import Sequence

import torch

from rheoplan.config import SamplingConfig, TreeConfig
from rheoplan.ir import DraftTree, empty_tree
from rheoplan.backends import resolve_backend
from rheoplan.pipeline import DraftFn, Instrument, PassContext, SamplerFn, lower, run_pipeline
from rheoplan.planner.assign import gumbel_sampler
from rheoplan.planner.default import DEFAULT_PIPELINE
from rheoplan.rng import Streams


def plan_tree(draft: DraftFn, root_tokens: Sequence[int] | torch.Tensor, *,
              tree: TreeConfig, sampling: SamplingConfig, prefix_len=None,
              seed: int = 0, step: int = 0, sampler: SamplerFn | None = None,
              passes: Sequence | None = None, instruments: Sequence[Instrument] = (),
              backend: str = "auto", device: torch.device | str | None = None,
              stream_keys: Sequence[int] | None = None) -> DraftTree:
    """Build, prune and linearise ``B = len(root_tokens)`` draft trees.

    ``draft(tree, nodes [B, n]) -> logits [B, n, V]`` is called once per depth.
    ``sampler`` overrides the Gumbel draw of sampled tokens (the oracle injects draws).
    ``passes`` (default ``DEFAULT_PIPELINE``) is lowered to ``backend`` (``'auto'``,
    ``'reference'``, ``'numba'``, ``'triton'``; see ``rheoplan.backends``): built-in passes
    run that backend's implementation, your own passes run as written. ``device`` is
    where the draft runs and, for ``'triton'``, where the planner's tensors live (default:
    the CPU, or CUDA for ``'triton'`` when present); the other backends plan on the CPU.
    ``stream_keys`` gives tree ``b`` the stream id ``stream_keys[b]`` for its draft draws
    (default: ``b``; the walk must use the same id, ``rheoplan.verify.walk(key=)``);
    ``step`` may be one int per tree (rows of a batch at different steps of their decodes).

    Example:
        >>> import torch
        >>> from rheoplan import TreeConfig, SamplingConfig
        >>> draft = lambda t, nodes: torch.zeros(nodes.shape[0], nodes.shape[1], 8)
        >>> t = plan_tree(draft, [3], tree=TreeConfig(depth=2, frontier=2, slots=2, budget=4, support=8),
        ...               sampling=SamplingConfig())
        >>> int(t.linear.n[0])
        5
    """
    if device is None and backend == "triton" and torch.cuda.is_available():
        device = "cuda"  # 'triton' plans on the GPU unless told otherwise
    backend = resolve_backend(backend, device)
    dev = torch.device(device) if backend == "triton" and device is not None else torch.device("cpu")
    roots = torch.as_tensor(root_tokens, dtype=torch.int64).reshape(-1)
    B = roots.numel()
    if B == 0:
        raise ValueError("root_tokens is empty: need one root token per tree")
    if prefix_len is None:
        prefix_len = torch.zeros(B, dtype=torch.int64)
    prefix_len = torch.as_tensor(prefix_len, dtype=torch.int64).reshape(-1).expand(B)
    if stream_keys is not None:
        stream_keys = [int(k) for k in stream_keys]
        if len(stream_keys) != B:
            raise ValueError(f"stream_keys has {len(stream_keys)} ids for {B} trees: allowed one id per tree")
    if not isinstance(step, int):
        step = [int(x) for x in step]
        if len(step) != B:
            raise ValueError(f"step has {len(step)} entries for {B} trees: allowed an int or one per tree")
    m = tree.effective_rheostat(sampling)
    t0 = empty_tree(B, tree.capacity, tree.max_expanded, tree.support, roots, prefix_len, m, tree.slots,
                    device=dev)
    ctx = PassContext(tree_cfg=tree, sampling=sampling, draft=draft,
                      sampler=sampler or gumbel_sampler(Streams(seed), step, stream_keys),
                      step=step if isinstance(step, int) else max(step),  # (instruments name files by it)
                      instruments=list(instruments))
    return run_pipeline(lower(DEFAULT_PIPELINE if passes is None else passes, backend), t0, ctx)
