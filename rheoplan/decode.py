"""``plan_and_decode``: the decode loop draft -> plan -> verify -> commit (batch 1).

One step:

1. plan: run the pass pipeline; its ``expand`` passes call the draft once per depth;
2. verify forward: the target runs the root and every kept node in one forward;
3. walk: the verifier walks from the root, asking for target logits only at the
   nodes it visits (lazy output projection), and emits accepted tokens + one more;
4. commit: both models keep the root and the accepted nodes; the last emitted
   token is the next root.

The baselines run in the same loop and differ only by configuration:
``draft=None`` is autoregressive sampling, ``TreeConfig.chain(D)`` chain speculative
sampling, ``TreeConfig.eagle(...)`` EAGLE's one-hot dynamic tree.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from rheoplan.config import ConfigError, SamplingConfig, TreeConfig
from rheoplan.ir import DraftTree, empty_tree
from rheoplan.pipeline import DumpIR
from rheoplan.plan import plan_tree
from rheoplan.rng import Streams


@dataclass
class StepStats:
    """What one draft-verify step did and how long each phase took (seconds)."""

    tree_size: int  #: drafted nodes kept (root excluded)
    accepted: int  #: drafted tokens accepted
    emitted: int  #: tokens emitted this step (accepted + 1, unless truncated)
    trials: int  #: nodes with kept children the walk reached (acceptance trials)
    visited: int  #: nodes whose target logits were computed
    t_draft: float = 0.0
    t_plan: float = 0.0
    t_verify_forward: float = 0.0
    t_walk: float = 0.0
    t_commit: float = 0.0


@dataclass
class DecodeResult:
    """Output of ``plan_and_decode``: the new tokens (prompt excluded) and per-step stats."""

    tokens: list[int]
    steps: list[StepStats] = field(default_factory=list)
    seconds: float = 0.0
    stopped_by: str = "max_new_tokens"  #: 'max_new_tokens' or 'eos'

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify step (accepted drafted tokens + 1), the paper's tau."""
        return sum(s.accepted + 1 for s in self.steps) / max(1, len(self.steps))

    @property
    def acceptance_rate(self) -> float:
        """Per-token acceptance: accepted drafted tokens / acceptance trials."""
        trials = sum(s.trials for s in self.steps)
        return sum(s.accepted for s in self.steps) / trials if trials else 0.0

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else float("nan")

    def phase_totals(self) -> dict[str, float]:
        keys = ["t_draft", "t_plan", "t_verify_forward", "t_walk", "t_commit"]
        return {k[2:]: sum(getattr(s, k) for s in self.steps) for k in keys}

    def summary(self) -> str:
        ph = self.phase_totals()
        n = max(1, len(self.steps))
        per = ", ".join(f"{k} {1e3 * v / n:.1f} ms" for k, v in ph.items())
        return (f"{len(self.tokens)} tokens in {len(self.steps)} steps, {self.seconds:.2f} s "
                f"({self.tokens_per_second:.1f} tok/s); mean accepted length "
                f"{self.mean_accepted_length:.2f}, per-token acceptance {self.acceptance_rate:.1%}; "
                f"per step: {per}")


def _check_prompt(prompt_ids, vocab_size: int) -> list[int]:
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() == 2 and prompt_ids.shape[0] == 1:
            prompt_ids = prompt_ids[0]
        if prompt_ids.dim() != 1:
            raise ValueError(f"prompt_ids must be 1-D (or [1, n]), got shape {tuple(prompt_ids.shape)}")
        prompt_ids = prompt_ids.tolist()
    try:
        ids = [int(t) for t in prompt_ids]
    except (TypeError, ValueError):
        raise TypeError(f"prompt_ids must be a sequence of ints, got {type(prompt_ids).__name__}") from None
    if any(isinstance(t, bool) for t in prompt_ids):
        raise TypeError("prompt_ids must hold ints, not bools")
    if not ids:
        raise ValueError("prompt_ids is empty: need at least one token (e.g. BOS)")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt_ids holds {bad[:5]} outside the vocabulary [0, {vocab_size})")
    return ids


def _check_int(name: str, value, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < lo:
        raise ValueError(f"{name}={value} is out of range: allowed >= {lo}")
    return value


def _root_only(root: int, prefix_len: int, tree: TreeConfig) -> DraftTree:
    """A tree with no drafted nodes (autoregressive steps), linearised."""
    from rheoplan.pipeline import PassContext
    from rheoplan.planner.linearize import linearize

    t = empty_tree(1, 1, 1, 1, torch.tensor([root]), torch.tensor([prefix_len]), tree.slots, tree.slots)
    return linearize(t, PassContext(tree_cfg=tree.with_(budget=1), sampling=SamplingConfig()))


def _trials(tree: DraftTree, path: Sequence[int]) -> int:
    lin = tree.linear
    return sum(1 for i in path if int(lin.n_children[0, i]) > 0)


def plan_and_decode(target, draft, prompt_ids, *, max_new_tokens: int,
                    sampling: SamplingConfig = SamplingConfig(),
                    tree: TreeConfig = TreeConfig(),
                    seed: int | None = None, eos_token_id: int | Collection[int] | None = None,
                    dump_ir: str | os.PathLike | None = None,
                    dump_steps: Collection[int] | None = (0,),
                    progress: bool = False, passes=None,
                    mutations: frozenset[str] = frozenset(),
                    callback=None) -> DecodeResult:
    """Decode up to ``max_new_tokens`` tokens after ``prompt_ids``, losslessly.

    Args:
        target: the model whose distribution is preserved: a transformers causal LM,
            a ``FunctionalLM``, or any ``rheoplan.models.base.TargetModel``.
        draft: the proposal model (standalone causal LM, EAGLE-3 head, ``FunctionalLM``,
            any ``DraftModel``) or ``None`` for plain autoregressive sampling.
        prompt_ids: the prompt, a non-empty sequence of token ids.
        max_new_tokens: tokens to generate at most (>= 1).
        sampling: target temperature / top-k / top-p; output follows exactly this law.
        tree: draft-tree shape and verifier (see ``TreeConfig``; presets ``TreeConfig.eagle``,
            ``TreeConfig.chain``).
        seed: one seed for every draw (drafting and verification use independent streams);
            ``None`` picks one at random.
        eos_token_id: stop at the first emitted token in this set (it is included).
        dump_ir: directory to write the IR after every pass, for the steps in ``dump_steps``
            (``None`` = every step).
        progress: show a progress bar.
        callback: called with the list of new tokens after every step (streaming).

    Example:
        >>> from rheoplan.models.functional import hashed_context_lm
        >>> lm = hashed_context_lm(vocab_size=6, seed=1)
        >>> r = plan_and_decode(lm, lm, [0, 1], max_new_tokens=5, seed=0,
        ...                     tree=TreeConfig(depth=2, frontier=2, slots=2, budget=4, support=6))
        >>> len(r.tokens)
        5
    """
    from rheoplan.models import as_draft, as_target
    from rheoplan.verify import walk

    if not isinstance(sampling, SamplingConfig):
        raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
    if not isinstance(tree, TreeConfig):
        raise TypeError(f"tree must be a TreeConfig, got {type(tree).__name__}")
    _check_int("max_new_tokens", max_new_tokens, 1)
    if seed is None:
        seed = random.randrange(2**62)
    streams = Streams(seed)  # validates the seed
    tgt = as_target(target)
    drf = as_draft(draft) if draft is not None else None
    ids = _check_prompt(prompt_ids, tgt.vocab_size)
    if drf is not None and drf.vocab_size != tgt.vocab_size:
        raise ValueError(f"draft vocab_size={drf.vocab_size} != target vocab_size={tgt.vocab_size}: "
                         "the draft must propose target token ids")
    if drf is not None and tree.slots > min(tree.support, tgt.vocab_size):
        raise ConfigError(f"slots={tree.slots} exceeds min(support={tree.support}, vocab={tgt.vocab_size})")
    eos = set() if eos_token_id is None else ({eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id))
    max_ctx = getattr(tgt, "max_context", None)
    if max_ctx is not None and len(ids) + max_new_tokens + tree.budget + 1 > max_ctx:
        raise ValueError(f"prompt ({len(ids)}) + max_new_tokens ({max_new_tokens}) + budget ({tree.budget}) "
                         f"exceeds the target's context of {max_ctx} tokens")
    if passes is None and drf is not None:
        passes = _default_passes()

    result = DecodeResult(tokens=[])
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=max_new_tokens, unit="tok", desc="decode")
    t_start = time.perf_counter()
    tgt.start(ids)
    if drf is not None:
        drf.start(ids)
    root, prefix_len, step = ids[-1], len(ids) - 1, 0
    while len(result.tokens) < max_new_tokens:
        st = StepStats(0, 0, 0, 0, 0)
        t0 = time.perf_counter()
        if drf is None:
            t = _root_only(root, prefix_len, tree)
        else:
            draft_time = [0.0]

            def draft_fn(tr, nodes, _acc=draft_time):
                t_d = time.perf_counter()
                valid = nodes[0][nodes[0] >= 0].tolist()
                out = drf.node_logits(tr, valid)
                _acc[0] += time.perf_counter() - t_d
                if out.shape[0] != len(valid):
                    raise ValueError(f"draft returned {out.shape[0]} rows for {len(valid)} nodes")
                return out.unsqueeze(0)

            instruments = []
            if dump_ir is not None and (dump_steps is None or step in dump_steps):
                instruments.append(DumpIR(Path(dump_ir)))
            t = plan_tree(draft_fn, [root], tree=tree, sampling=sampling, prefix_len=[prefix_len],
                          seed=seed, step=step, passes=passes, instruments=instruments,
                          mutations=mutations)
            st.t_draft = draft_time[0]
        t1 = time.perf_counter()
        st.t_plan = t1 - t0 - st.t_draft
        fw = tgt.forward_tree(t.linear)
        t2 = time.perf_counter()
        res = walk(t, 0, fw.logits, sampling, tree.verifier, streams, step, mutations=mutations)
        t3 = time.perf_counter()
        emitted = list(res.emitted)
        stop = None
        for j, tok in enumerate(emitted):
            if tok in eos:
                emitted, stop = emitted[: j + 1], "eos"
                break
        room = max_new_tokens - len(result.tokens)
        if len(emitted) > room:
            emitted = emitted[:room]
        st.tree_size = int(t.linear.n[0]) - 1
        st.accepted = len(res.path) - 1
        st.emitted = len(emitted)
        st.trials = _trials(t, res.path)
        st.visited = res.visited
        st.t_verify_forward, st.t_walk = t2 - t1, t3 - t2
        result.tokens += emitted
        if bar is not None:
            bar.update(len(emitted))
        if callback is not None:
            callback(emitted)
        if stop is None and len(result.tokens) < max_new_tokens:
            t4 = time.perf_counter()
            tgt.commit(list(res.path))
            if drf is not None:
                feats = [fw.features(i) for i in res.path]
                drf.commit(t, list(res.nodes), list(res.emitted), feats)
            st.t_commit = time.perf_counter() - t4
        result.steps.append(st)
        if stop is not None:
            result.stopped_by = stop
            break
        root, prefix_len, step = res.emitted[-1], prefix_len + len(res.path), step + 1
    result.seconds = time.perf_counter() - t_start
    if bar is not None:
        bar.close()
    return result


def _default_passes():
    """The kernel-backed CPU pipeline when it is available, else the reference passes."""
    try:
        from rheoplan.kernels.pipeline import kernel_pipeline
    except ImportError:
        return None
    return kernel_pipeline("cpu")
