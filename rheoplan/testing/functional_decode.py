"""A pure multi-step decode loop for functional models (the real sampling path, not the
oracle): ``plan_tree`` with the Gumbel draft sampler, then ``rheoplan.verify.walk`` with
the counter-based streams, step after step. The statistical tests run it over many
independent runs and compare the empirical law with ``exact_law``.

Run ``r`` of a batch uses stream id ``r`` (the ``tree`` counter of ``rheoplan.rng``) for
both drafting and verifying, so ``functional_decode(..., seed=s)`` equals run 0 of
``functional_decode_batch(..., seed=s)``, and runs never share random numbers.

Mutation controls: run it inside ``rheoplan.testing.mutation(...)``.
"""

from __future__ import annotations

from typing import Sequence

import torch

from rheoplan.config import SamplingConfig, TreeConfig
from rheoplan.decode import root_only_rows
from rheoplan.plan import plan_tree
from rheoplan.rng import Purpose, Streams
from rheoplan.testing.oracle import functional_draft_fn_batch
from rheoplan.verify import walk


def _draft_sampler(streams: Streams, step: int, keys: list[int]):
    def draw(b: int, node: int, qtilde: torch.Tensor) -> int:
        g = streams.gumbel(step, keys[b], node, Purpose.DRAFT_SAMPLE, qtilde.numel())
        return int(torch.argmax(torch.log(qtilde) + g))

    return draw


def functional_decode_batch(target, draft, prefix: Sequence[int], n_tokens: int, n_runs: int, *,
                            tree: TreeConfig, sampling: SamplingConfig, seed: int = 0,
                            max_steps: int | None = None, processors=(),
                            plain_first: bool = False) -> list[tuple[int, ...]]:
    """``n_runs`` independent decodes of ``n_tokens`` tokens each (truncated), batched.

    Every step plans one tree per unfinished run (one ``plan_tree`` call, stream id = run
    index) and verifies it with ``walk``. Returns the emitted tokens of each run.
    ``processors`` are logits processors of the target law (as in ``plan_and_decode``).
    ``plain_first``: step 0 has no tree (its root only), as in ``plan_and_decode`` with a
    target adapter that serves the first token from the prompt's forward.
    """
    if n_runs < 1:
        raise ValueError(f"n_runs={n_runs} is out of range: allowed >= 1")
    if len(prefix) == 0:
        raise ValueError("prefix is empty: it must end with the first root token")
    draft_streams = Streams(seed)
    verify_streams = Streams(seed)
    ctxs = [tuple(int(t) for t in prefix) for _ in range(n_runs)]
    out: list[list[int]] = [[] for _ in range(n_runs)]
    step = 0
    while True:
        active = [r for r in range(n_runs) if len(out[r]) < n_tokens]
        if not active:
            break
        if max_steps is not None and step >= max_steps:
            raise RuntimeError(f"decode did not finish in max_steps={max_steps}")
        if plain_first and step == 0:
            t = root_only_rows([ctxs[r][-1] for r in active], [len(ctxs[r]) - 1 for r in active], tree)
        else:
            t = plan_tree(functional_draft_fn_batch(draft, [ctxs[r] for r in active]),
                          [ctxs[r][-1] for r in active], tree=tree, sampling=sampling,
                          prefix_len=[len(ctxs[r]) - 1 for r in active], step=step,
                          sampler=_draft_sampler(draft_streams, step, active))
        lin = t.linear
        for b, r in enumerate(active):
            def logits_at(i: int, b=b, r=r) -> torch.Tensor:
                toks = []
                j = i
                while j > 0:
                    toks.append(int(lin.token[b, j]))
                    j = int(lin.parent[b, j])
                return target([ctxs[r] + tuple(toks[::-1])])[0]

            res = walk(t, b, logits_at, sampling, tree.verifier, verify_streams, step, key=r,
                       history=ctxs[r], processors=processors)
            out[r] += res.emitted
            ctxs[r] = ctxs[r] + tuple(res.emitted)
        step += 1
    return [tuple(o[:n_tokens]) for o in out]


def functional_decode(target, draft, prefix: Sequence[int], n_tokens: int, *, tree: TreeConfig,
                      sampling: SamplingConfig, seed: int = 0, processors=()) -> list[int]:
    """One decode of ``n_tokens`` tokens with functional models (see the module docstring).

    Example:
        >>> from rheoplan.models.functional import hashed_context_lm
        >>> from rheoplan import TreeConfig, SamplingConfig
        >>> tgt, drf = hashed_context_lm(5, seed=1), hashed_context_lm(5, seed=2)
        >>> cfg = TreeConfig(depth=2, frontier=2, slots=2, budget=4, support=5)
        >>> len(functional_decode(tgt, drf, [0, 1], 4, tree=cfg, sampling=SamplingConfig(), seed=3))
        4
    """
    return list(functional_decode_batch(target, draft, prefix, n_tokens, 1, tree=tree, sampling=sampling,
                                        seed=seed, processors=processors)[0])
