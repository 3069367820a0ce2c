"""``plan_and_decode``: the decode loop draft -> plan -> verify -> commit.

A single prompt runs ``_decode`` (batch 1); a list of prompts runs ``_decode_rows``, the same
step for every live row at once (one planner call, one target forward; docs/batch.md).

One step:

1. plan: run the pass pipeline, lowered to the backend (``rheoplan.backends``); its
   ``expand`` passes call the draft once per depth (one batched call);
2. verify forward: the target runs the root and every kept node in one forward;
3. walk (``rheoplan.walk``): the verifier walks from the root and emits accepted tokens +
   one more; on the CPU backends it reads target logits from one projection of every
   node or of the likely path then node by node, whichever the target measured cheaper
   (``TreeLogits.prefers_all_logits``), on 'triton' the walk kernel runs on the device and
   the host receives the tokens in one transfer;
4. commit: both models keep the root and the accepted nodes; the last emitted
   token is the next root.

The baselines run in the same loop and differ only by configuration:
``draft=None`` is autoregressive sampling, ``TreeConfig.chain(D)`` chain speculative
sampling, ``TreeConfig.eagle(...)`` EAGLE's one-hot dynamic tree.
"""

from __future__ import annotations

import copy
import numbers
import os
import random
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

import torch
from tqdm.auto import tqdm

from rheoplan.backends import check_backend, resolve_backend
from rheoplan.config import ConfigError, SamplingConfig, TreeConfig
from rheoplan.costmodel import BatchPlan, Calibration, CostModel, CostPlan, Timings, prefill_groups
from rheoplan.distributions import SubsetLogits, greedy_tokens
from rheoplan.ir import DraftTree, HostTreeArena, empty_tree
from rheoplan.kernels.argmax import first_max
from rheoplan.kernels.plan.cpu_pass import decide as numba_decide, frontiers as numba_frontiers
from rheoplan.kernels.plan.cpu_pipeline import plan_cost_tree
from rheoplan.models import as_draft, as_target
from rheoplan.models.base import DraftModel, TargetModel
from rheoplan.mutation import active
from rheoplan.pipeline import DumpIR, PassContext, debug_level, lower
from rheoplan.plan import plan_tree
from rheoplan.planner.default import DEFAULT_PIPELINE, cost_pipeline
from rheoplan.planner.linearize import linearize
from rheoplan.rng import Streams
from rheoplan.walk import likely_path, verify_roots, verify_tree


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
    t_step: float = 0.0  #: the whole step, wall clock (the loop's own bookkeeping included)
    #: of ``t_walk``: projecting the target's hidden states to logits as the walk asks for
    #: them (``TreeLogits.projection_seconds``): the output matrix, model compute that
    #: ``generate`` counts inside its forward; the rest of the walk is the walk's own work
    t_project: float = 0.0
    #: with a cost model: did the step draft, and what the model predicted for its tree
    drafted: bool = True
    predicted_tokens: float | None = None  #: E, expected emitted tokens
    predicted_ms: float | None = None  #: predicted step latency


@dataclass
class DecodeResult:
    """Output of ``plan_and_decode``: the new tokens (prompt excluded) and per-step stats."""

    tokens: list[int]
    steps: list[StepStats] = field(default_factory=list)
    #: wall seconds from the start of the decode (of the whole batch, for a row) until
    #: this decode (row) finished, prefill included
    seconds: float = 0.0
    #: 'max_new_tokens', 'eos', or 'cancelled' (``decode_requests``: the request's event
    #: was set; ``tokens`` holds what it emitted before)
    stopped_by: str = "max_new_tokens"
    #: on the same clock: when the row joined the batch (its prefill began: about 0 for the
    #: rows the decode starts with, exactly 0 for a single sequence) and when its first
    #: token was emitted.
    #: A row's latency is ``seconds - joined_seconds``, its time to first token
    #: ``first_token_seconds - joined_seconds`` (continuous batching: docs/batch.md)
    joined_seconds: float = 0.0
    first_token_seconds: float | None = None
    #: with a cost model: the calibration this decode ended with (save it with
    #: ``Calibration.save`` and pass it as a later decode's prior)
    calibration: Calibration | None = None

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
        """Seconds per phase over the steps: ``draft``, ``plan``, ``verify_forward``,
        ``walk``, ``commit`` (they add up to the steps' time but the loop's own), and
        ``project``, the part of ``walk`` spent in the output projection."""
        keys = ["t_draft", "t_plan", "t_verify_forward", "t_walk", "t_commit", "t_project"]
        return {k[2:]: sum(getattr(s, k) for s in self.steps) for k in keys}

    @property
    def predicted_tokens_per_step(self) -> float | None:
        """The cost model's mean expected tokens per step (None without a cost model)."""
        pred = [s.predicted_tokens for s in self.steps if s.predicted_tokens is not None]
        return sum(pred) / len(pred) if pred else None

    def summary(self) -> str:
        ph = self.phase_totals()
        n = max(1, len(self.steps))
        proj = ph.pop("project")
        per = ", ".join(f"{k} {1e3 * v / n:.1f} ms" for k, v in ph.items())
        if proj > 0:
            per += f" (of the walk, output projection {1e3 * proj / n:.1f} ms)"
        out = (f"{len(self.tokens)} tokens in {len(self.steps)} steps, {self.seconds:.2f} s "
               f"({self.tokens_per_second:.1f} tok/s); mean accepted length "
               f"{self.mean_accepted_length:.2f}, per-token acceptance {self.acceptance_rate:.1%}; "
               f"per step: {per}")
        pred = self.predicted_tokens_per_step
        if pred is not None:
            ar = sum(1 for s in self.steps if not s.drafted)
            out += (f"; cost model: predicted {pred:.2f} tokens/step (measured "
                    f"{self.mean_accepted_length:.2f}), {ar} of {len(self.steps)} steps autoregressive")
        return out


def _check_prompt(prompt_ids, vocab_size: int) -> list[int]:
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() == 2 and prompt_ids.shape[0] == 1:
            prompt_ids = prompt_ids[0]
        if prompt_ids.dim() != 1:
            raise ValueError(f"prompt_ids has shape {tuple(prompt_ids.shape)}: allowed a 1-D sequence "
                             "(or [1, n]) of token ids")
        if prompt_ids.dtype.is_floating_point or prompt_ids.dtype == torch.bool:
            raise TypeError(f"prompt_ids has dtype {prompt_ids.dtype}: allowed an integer tensor")
        prompt_ids = prompt_ids.tolist()
    if isinstance(prompt_ids, (str, bytes)) or not hasattr(prompt_ids, "__iter__"):
        raise TypeError(f"prompt_ids={prompt_ids!r} is a {type(prompt_ids).__name__}: allowed a "
                        "sequence of int token ids")
    prompt_ids = list(prompt_ids)
    wrong = [t for t in prompt_ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
    if wrong:
        raise TypeError(f"prompt_ids holds {wrong[:5]!r} ({type(wrong[0]).__name__}): allowed int "
                        "token ids")
    ids = [int(t) for t in prompt_ids]
    if not ids:
        raise ValueError("prompt_ids=[] is empty: allowed a non-empty sequence of token ids "
                         "(at least one token, e.g. BOS; the last one is the first root)")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt_ids holds token ids {bad[:5]} out of range: allowed ids in "
                         f"[0, {vocab_size}) (the target's vocabulary)")
    return ids


def _check_eos(eos_token_id, vocab_size: int) -> set[int]:
    if eos_token_id is None:
        return set()
    ids = [eos_token_id] if isinstance(eos_token_id, numbers.Integral) else eos_token_id
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise TypeError(f"eos_token_id={eos_token_id!r} is a {type(eos_token_id).__name__}: allowed "
                        "None, an int token id or a collection of them")
    ids = list(ids)
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise TypeError(f"eos_token_id={eos_token_id!r} holds {t!r} ({type(t).__name__}): allowed "
                            "int token ids")
        if not 0 <= t < vocab_size:
            raise ValueError(f"eos_token_id={eos_token_id!r} is out of range: allowed ids in "
                             f"[0, {vocab_size}) (the target's vocabulary)")
    return {int(t) for t in ids}


def _check_processors(processors) -> tuple:
    if processors is None:
        return ()
    if callable(processors) and not isinstance(processors, (list, tuple)):
        processors = [processors]  # one processor (a LogitsProcessorList is a list)
    if isinstance(processors, (str, bytes)) or not hasattr(processors, "__iter__"):
        raise TypeError(f"logits_processors={processors!r} is a {type(processors).__name__}: allowed "
                        "None or a list of transformers LogitsProcessor objects")
    processors = tuple(processors)
    bad = [p for p in processors if not callable(p)]
    if bad:
        raise TypeError(f"logits_processors holds {bad[0]!r} ({type(bad[0]).__name__}), not callable: "
                        "allowed transformers LogitsProcessor objects or callables "
                        "(input_ids [1, n], scores [1, V]) -> scores")
    return processors


def _check_pair(tgt: TargetModel, drf: DraftModel) -> None:
    """Target/draft compatibility: vocabulary, device, the draft's own vocabulary map."""
    if drf.vocab_size != tgt.vocab_size:
        raise ValueError(f"draft vocab_size={drf.vocab_size} does not match the target's: allowed "
                         f"vocab_size={tgt.vocab_size} (the draft must propose target token ids)")
    t_dev, d_dev = tgt.device, drf.device
    if t_dev is not None and d_dev is not None and torch.device(t_dev) != torch.device(d_dev):
        raise ValueError(f"draft device={d_dev} does not match the target's: allowed "
                         f"device={t_dev} (put both models on the same device)")
    drf.check_vocab_map(tgt.vocab_size)
    drf.check_target(tgt)
    ids = drf.vocab_ids
    if ids is not None:
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.numel() < 1 or ids.dtype.is_floating_point:
            raise ValueError(f"draft vocab_ids={ids!r}: allowed None or a non-empty 1-D integer tensor of "
                             "target token ids")
        ok = torch.stack([(ids[1:] > ids[:-1]).all(), ids[0] >= 0, ids[-1] < tgt.vocab_size])
        if not all(ok.tolist()):  # one read per decode
            raise ValueError(f"draft vocab_ids must be strictly increasing target ids in [0, {tgt.vocab_size}) "
                             "(increasing ids keep the planner's ties-to-the-lower-id rule)")


def _check_int(name: str, value, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}={value!r} is a {type(value).__name__}: allowed an int >= {lo}")
    if value < lo:
        raise ValueError(f"{name}={value} is out of range: allowed >= {lo}")
    return value


def _root_only(root: int, prefix_len: int, tree: TreeConfig, device: torch.device | str = "cpu") -> DraftTree:
    """A tree with no drafted nodes (an autoregressive step), linearised, on ``device``
    (the planner's: the target's for 'triton')."""
    return root_only_rows([root], [prefix_len], tree, device)


def root_only_rows(roots: Sequence[int], prefix_lens: Sequence[int], tree: TreeConfig,
                    device: torch.device | str = "cpu") -> DraftTree:
    """``len(roots)`` trees with no drafted nodes (a batch's autoregressive step, or the
    first step a target serves from the prompt's forward), linearised, on ``device``.

    Built once per batch size and then only re-stamped with the root tokens and their
    positions: linearising one-node trees every step cost about 1% of a token at batch 1
    and 2-3% of a step at batch 16 on a 2-core CPU.
    """
    device = torch.device(device)
    B = len(roots)
    key = (B, tree.slots, str(device))
    tmpl = _ROOT_ONLY.get(key)
    if tmpl is None:
        t = empty_tree(B, 1, 1, 1, torch.zeros(B, dtype=torch.int64), torch.zeros(B, dtype=torch.int64),
                       tree.slots, tree.slots)
        t = linearize(t, PassContext(tree_cfg=tree.with_(budget=1), sampling=SamplingConfig()))
        tmpl = _ROOT_ONLY[key] = t.to(device)
    lin = tmpl.linear
    r = torch.as_tensor(list(roots), dtype=torch.int64).to(device)
    pl = torch.as_tensor(list(prefix_lens), dtype=torch.int64).to(device)
    token, lin_token, position = tmpl.token.clone(), lin.token.clone(), lin.position.clone()
    token[:, 0] = lin_token[:, 0] = r
    position[:, 0] = pl
    return tmpl.replace(token=token, prefix_len=pl, linear=replace(lin, token=lin_token, position=position))


#: one linearised root-only batch per (batch size, slot count, device); ``root_only_rows``
#: copies it with new values
_ROOT_ONLY: dict[tuple, DraftTree] = {}


@dataclass
class DecodeState:
    """One decode: its checked inputs and where the loop is.

    ``plan_and_decode`` checks every argument, builds this once, and the loop reads
    nothing else. A new decode option is one field here (with a default, below the
    required ones), its check in ``plan_and_decode``, and its use in the loop.
    """

    target: TargetModel
    draft: DraftModel | None  #: None: autoregressive sampling (no tree)
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingConfig
    tree: TreeConfig
    seed: int
    streams: Streams = field(init=False)
    eos: frozenset[int] = frozenset()
    passes: Sequence | None = None  #: the pass list (None: ``DEFAULT_PIPELINE``), lowered to ``backend``
    backend: str = "numba"  #: a concrete backend ('reference', 'numba', 'triton'; ``rheoplan.backends``)
    dump_ir: Path | None = None
    dump_steps: Collection[int] | None = (1,)
    progress: bool = False
    callback: Callable[[list[int]], None] | None = None
    #: caller logits processors of the target law (``plan_and_decode(logits_processors=)``)
    processors: tuple = ()
    cost: CostModel | None = None  #: plan trees by the cost model (None: a fixed budget)
    calibration: Calibration | None = None  #: this decode's online calibration (with ``cost``)
    # -- where the loop is ----------------------------------------------------------------
    root: int = field(init=False)  #: the next tree's root (last emitted token)
    prefix_len: int = field(init=False)  #: tokens committed before the root
    step: int = 0
    result: DecodeResult = field(default_factory=lambda: DecodeResult(tokens=[]))
    #: ``passes`` lowered to ``backend`` once per decode (``pipeline.lower``: ~45 us a step)
    lowered: list = field(init=False)
    #: the cost-aware plan may run fused (``kernels.plan.cpu_pipeline``): numba, the built-in
    #: passes, and ``RHEOPLAN_DEBUG`` 0 (no instrument; read once a decode); a step that
    #: dumps its IR runs the pass list
    fused_plan: bool = field(init=False)
    #: the fused plan's tree tables, reset each step (a step is done with its tree before
    #: the next plans)
    host_trees: HostTreeArena = field(init=False, default_factory=HostTreeArena)

    def __post_init__(self) -> None:
        self.streams = Streams(self.seed)
        self.lowered = lower(DEFAULT_PIPELINE if self.passes is None else self.passes, self.backend)
        self.fused_plan = self.backend == "numba" and self.passes is None and debug_level() == 0
        self.root, self.prefix_len = self.prompt[-1], len(self.prompt) - 1
        if self.cost is not None and self.calibration is None:
            self.calibration = self.cost.fresh_calibration(self.sampling.temperature)

    @property
    def plan_device(self) -> torch.device:
        """Where the planner's tensors live: the target's device for 'triton', else the CPU."""
        if self.backend == "triton" and self.target.device is not None:
            return torch.device(self.target.device)
        return torch.device("cpu")

    @property
    def remaining(self) -> int:
        """Tokens still to emit before ``max_new_tokens``."""
        return self.max_new_tokens - len(self.result.tokens)


def plan_and_decode(target, draft, prompt_ids, *, max_new_tokens: int,
                    sampling: SamplingConfig = SamplingConfig(),
                    tree: TreeConfig = TreeConfig(),
                    seed: int | None = None, eos_token_id: int | Collection[int] | None = None,
                    dump_ir: str | os.PathLike | None = None,
                    dump_steps: Collection[int] | None = (1,),
                    progress: bool = False, passes=None,
                    callback=None, logits_processors=None,
                    cost_model: CostModel | None = None, backend: str = "auto",
                    attention_mask=None, stream_ids: Sequence[int] | None = None,
                    max_batch_size: int | None = None,
                    ) -> DecodeResult | list[DecodeResult]:
    """Decode up to ``max_new_tokens`` tokens after ``prompt_ids``, losslessly.

    Batched decoding: pass several prompts (a list of token-id sequences, or a padded 2-D
    tensor with ``attention_mask=``) and get one ``DecodeResult`` per row (see
    "Batched decoding" below and docs/batch.md).

    Args:
        target: the model whose distribution is preserved: a transformers causal LM,
            a ``FunctionalLM``, or any ``rheoplan.models.TargetModel``.
        draft: the proposal model (standalone causal LM, EAGLE-3 head, ``FunctionalLM``,
            any ``rheoplan.models.DraftModel``) or ``None`` for plain autoregressive sampling.
        prompt_ids: the prompt, a non-empty sequence of token ids.
        max_new_tokens: tokens to generate at most (>= 1).
        sampling: how the target's scores are processed (temperature, top-k, top-p, min-p,
            typical-p, repetition penalty, with transformers' semantics); the output follows
            exactly this law, the one ``generate`` samples from with the same settings.
        tree: draft-tree shape and verifier (see ``TreeConfig``; presets ``TreeConfig.eagle``,
            ``TreeConfig.chain``).
        seed: one seed for every draw (drafting and verification use independent streams);
            ``None`` picks one at random.
        eos_token_id: stop at the first emitted token in this set (it is included).
        dump_ir: directory to write the IR after every pass, for the steps in ``dump_steps``
            (``None`` = every step; default step 1, the first planned tree: step 0 draws the
            first new token from the prompt's forward, with no tree to plan, for every target
            adapter whose ``start_and_root`` serves it).
        progress: show a progress bar.
        passes: the pass list that plans each tree (default ``DEFAULT_PIPELINE``); its
            built-in passes are lowered to ``backend``, your own passes run as written.
        callback: called with the list of new tokens after every step (streaming).
        logits_processors: transformers ``LogitsProcessor`` objects (or callables
            ``(input_ids [1, n], scores [1, V]) -> scores``) applied to the target's scores at
            every tree node, with that node's own context as ``input_ids`` (prompt + emitted +
            the path to the node), after the repetition penalty and before the warpers, as
            ``generate(logits_processor=...)`` applies them. The draft does not see them.
        cost_model: plan each tree by the cost model (``rheoplan.costmodel.CostModel``:
            latencies measured at load, ``rheoplan.probe.measure_timings``, and an optional
            prior calibration): ``tree`` then gives the largest shape (depth, frontier,
            slots, budget); drafting stops at the depth where another draft call cannot
            pay, nodes are kept only while they pay for their verify cost, and a step
            where no tree pays is a plain autoregressive step (drafting is retried later).
            Decisions use only the frozen latencies and earlier steps' acceptances, so the
            output law is unchanged and the same seed gives the same tokens. A batch's
            prompts are prefilled in groups of similar lengths where that costs less than
            one forward padded to the longest (``rheoplan.costmodel.prefill_groups``; with
            or without a draft).
        attention_mask: with a padded ``[B, n]`` tensor ``prompt_ids``: 1 at the tokens of
            each row, 0 at its padding (left or right, as transformers tokenizers make it).
        stream_ids: batched decoding only: the stream id of each row (default ``0 .. B-1``).
        max_batch_size: batched decoding only: at most this many rows decode at once; the
            other prompts wait and join, in order, as rows finish (continuous batching).
            Default: every prompt at once.
        backend: which implementation plans and verifies (``rheoplan.backends``):
            ``'auto'`` (Triton when the target is on a CUDA device, numba on the CPU),
            ``'reference'``, ``'numba'`` or ``'triton'`` (the planner, the noise and the walk
            on the target's device; a CUDA device or ``TRITON_INTERPRET=1``). Every backend
            emits the same tokens for the same seed. With ``'triton'`` a transformers model
            passed as ``target`` also runs its verify forward through the Triton tree-attention
            kernel; an ``HFTarget`` you built keeps its own ``use_tree_attention`` setting.

    Batched decoding:
        ``prompt_ids`` is a list of token-id sequences (lists or 1-D tensors, lengths may
        differ) or a ``[B, n]`` integer tensor with ``attention_mask``; the result is a list
        of ``DecodeResult``, row by row. ``max_new_tokens`` is an int or one int per row;
        each row stops at its own EOS or limit and leaves the batch. Every step plans all
        live rows' trees in one planner call (one draft call per depth for all rows) and
        verifies them in one target forward (trees padded to the largest with masked-out
        dummy nodes; each row attends only to its own cache entries). ``callback(row,
        new_tokens)`` streams. Row ``b`` draws its randomness from stream ``(seed,
        stream_ids[b])``: the ``tree`` word of every counter of ``rheoplan.rng`` is the
        row's stream id (default ``b``). So a row's tokens do not depend on the other rows:
        ``plan_and_decode(t, d, [p], seed=s, stream_ids=[i])`` gives the tokens of row ``i``
        of a batch with seed ``s`` (same backend, float32 models; a single sequence is
        stream id 0, so it equals row 0). With ``cost_model`` the cost passes decide
        each step's trees for the whole batch of live rows (``Timings.verify_batch``). Backends 'reference' and
        'numba' ('auto' picks 'numba', whatever the device); 'triton' walks one tree per
        call and is refused for the batch form.

    Example:
        >>> from rheoplan.models import hashed_context_lm
        >>> lm = hashed_context_lm(vocab_size=6, seed=1)
        >>> r = plan_and_decode(lm, lm, [0, 1], max_new_tokens=5, seed=0,
        ...                     tree=TreeConfig(depth=2, frontier=2, slots=2, budget=4, support=6))
        >>> len(r.tokens)
        5
    """
    # Every check runs before any model work (house rule 8): adapters are built, nothing runs.
    check_backend(backend)
    batched = _is_batch(prompt_ids, attention_mask)
    if not batched:
        if attention_mask is not None:
            raise ValueError("attention_mask is set but prompt_ids is one sequence: allowed "
                             "attention_mask only with a padded [B, n] tensor prompt_ids")
        if stream_ids is not None:
            raise ValueError("stream_ids is set but prompt_ids is one sequence: allowed stream_ids "
                             "only for a batch (pass [prompt] to decode one row with its own stream id)")
        if max_batch_size is not None:
            raise ValueError("max_batch_size is set but prompt_ids is one sequence: allowed "
                             "max_batch_size only for a batch (a list of prompts)")
    elif max_batch_size is not None:
        _check_int("max_batch_size", max_batch_size, 1)
    if not batched:
        _check_int("max_new_tokens", max_new_tokens, 1)
    seed, processors = check_decode_args(sampling, tree, seed, callback, logits_processors, cost_model)
    # One sequence without a draft needs no EAGLE-3 features: no capture hooks on its forwards
    tgt = as_target(target) if batched or draft is not None else as_target(target, capture_layers=None)
    drf = None
    try:
        drf = as_draft(draft) if draft is not None else None
        if batched:
            prompts = _check_prompts(prompt_ids, attention_mask, tgt.vocab_size)
            limits = _check_max_new_rows(max_new_tokens, len(prompts))
            keys = _check_stream_ids(stream_ids, len(prompts))
        else:
            ids = _check_prompt(prompt_ids, tgt.vocab_size)
        eos = check_models(tgt, drf, tree, eos_token_id)
        budget = tree.budget if drf is not None else None
        if batched:
            for b, (p, n) in enumerate(zip(prompts, limits)):
                _check_context(tgt, len(p), n, budget, row=b)
            if backend == "triton":
                raise ValueError(f"backend='triton' decodes a single sequence (its walk runs one tree), "
                                 f"got a batch of {len(prompts)} rows: allowed backend='auto', 'reference' "
                                 "or 'numba' for batched decoding")
            # 'auto' plans a batch with numba on the host (the Triton walk takes one tree)
            backend = "numba" if backend == "auto" else backend
            max_batch = len(prompts) if max_batch_size is None else min(max_batch_size, len(prompts))
            _check_memory(tgt, drf, prompts, limits, budget, max_batch)
            if drf is not None:
                _warm_up(backend)
            state = BatchState(target=tgt, draft=drf, prompts=prompts, limits=limits, keys=keys,
                               sampling=sampling, tree=tree, seed=seed, eos=frozenset(eos), passes=passes,
                               backend=backend, dump_ir=None if dump_ir is None else Path(dump_ir),
                               dump_steps=dump_steps, progress=progress, callback=callback,
                               processors=processors, cost=cost_model if drf is not None else None,
                               max_batch=max_batch,
                               prefill_overhead=prefill_overhead(cost_model))
            return _decode_rows(state)
        _check_context(tgt, len(ids), max_new_tokens, budget)
        backend = resolve_backend(backend, tgt.device)
        if backend == "triton" and drf is not None and tgt is not target:
            # The Triton backend's verify forward runs the tree-attention kernel too. Only on an
            # adapter built here (closed below); an adapter passed in keeps the caller's choice.
            tgt.use_tree_attention(True)
        if drf is not None:
            _warm_up(backend)
        state = DecodeState(target=tgt, draft=drf, prompt=ids, max_new_tokens=max_new_tokens,
                            sampling=sampling, tree=tree, seed=seed, eos=frozenset(eos), passes=passes,
                            backend=backend,
                            dump_ir=None if dump_ir is None else Path(dump_ir), dump_steps=dump_steps,
                            progress=progress, callback=callback,
                            processors=processors,
                            cost=cost_model if drf is not None else None)
        return _decode(state)
    finally:
        # Adapters built here are closed here (an HF target hooks its model's layers).
        if tgt is not target:
            tgt.close()
        if drf is not None and drf is not draft:
            drf.close()


def check_decode_args(sampling, tree, seed, callback, logits_processors, cost_model) -> tuple[int, tuple]:
    """The checks of ``plan_and_decode``'s arguments that need no model: returns the seed
    (drawn at random when None) and the checked logits processors."""
    if not isinstance(sampling, SamplingConfig):
        raise TypeError(f"sampling={sampling!r} is a {type(sampling).__name__}: allowed a SamplingConfig")
    if not isinstance(tree, TreeConfig):
        raise TypeError(f"tree={tree!r} is a {type(tree).__name__}: allowed a TreeConfig")
    if seed is None:
        seed = random.randrange(2**62)
    elif isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed={seed!r} is a {type(seed).__name__}: allowed None or an int in [0, 2**63)")
    Streams(seed)  # validates the seed's range
    if callback is not None and not callable(callback):
        raise TypeError(f"callback={callback!r} is not callable: allowed None or a function of the "
                        "new tokens")
    processors = _check_processors(logits_processors)
    if cost_model is not None and not isinstance(cost_model, CostModel):
        raise TypeError(f"cost_model={cost_model!r} is a {type(cost_model).__name__}: allowed None or a "
                        "rheoplan.costmodel.CostModel")
    return seed, processors


def check_models(tgt: TargetModel, drf: DraftModel | None, tree: TreeConfig, eos_token_id) -> set[int]:
    """The checks that need the adapters (before any model work): the EOS ids (returned as
    a set), the draft against the target, the tree's slots against the vocabulary."""
    eos = _check_eos(eos_token_id, tgt.vocab_size)
    if drf is not None:
        _check_pair(tgt, drf)
        if tree.slots > min(tree.support, tgt.vocab_size):
            raise ConfigError(f"slots={tree.slots} is out of range: allowed <= min(support={tree.support}, "
                              f"vocab={tgt.vocab_size}) = {min(tree.support, tgt.vocab_size)}")
    return eos


def _check_context(tgt: TargetModel, n_prompt: int, max_new_tokens: int, budget: int | None,
                   row: int | None = None) -> None:
    """The largest cache (every committed token plus one verify tree: root + ``budget``
    drafted nodes; ``budget=None`` without a draft) fits the target's ``max_context``."""
    max_ctx = tgt.max_context
    tree_len = 1 + (budget or 0)
    if max_ctx is not None and n_prompt + max_new_tokens + tree_len > max_ctx:
        what = "prompt + max_new_tokens + budget + 1" if budget is not None else "prompt + max_new_tokens + 1"
        if row is not None:
            what = f"row {row}: {what}"
        raise ValueError(f"{what} = {n_prompt} + {max_new_tokens}"
                         + (f" + {budget}" if budget is not None else "") + " + 1 = "
                         f"{n_prompt + max_new_tokens + tree_len} is out of range: allowed <= the "
                         f"target's context max_context={max_ctx}")


def _plan(s: DecodeState, st: StepStats) -> DraftTree:
    """This step's linearised tree (root only without a draft); draft time goes to ``st``."""
    if s.draft is None:
        st.drafted = False
        return _root_only(s.root, s.prefix_len, s.tree, s.plan_device)
    drf = s.draft
    on_device = s.backend == "triton"

    def draft_fn(tr, nodes):
        t_d = time.perf_counter()
        # The device planner sizes its frontier on the host (every entry is a real node):
        # the draft gets the ids as a device tensor, with no host sync. The CPU planners
        # pad with -1 and pass a list.
        valid = nodes[0] if on_device else [v for v in nodes[0].tolist() if v >= 0]
        out = draft_answer(drf, tr, valid)
        st.t_draft += time.perf_counter() - t_d
        return out

    instruments = []
    if s.dump_ir is not None and (s.dump_steps is None or s.step in s.dump_steps):
        instruments.append(DumpIR(s.dump_ir))
    if s.cost is None:
        passes = s.lowered
    else:
        # every step asks the head: no back-off after a step where no tree paid (one
        # sequence: a skipped step missed trees that would have paid; docs/cli.md)
        plan, seen = _cost_plan(s, st)
        if s.fused_plan and not instruments:  # nothing watches the passes: run them fused
            return plan_cost_tree(draft_fn, [s.root], tree=s.tree, sampling=s.sampling, plan=plan,
                                  prefix_len=[s.prefix_len], seed=s.seed, step=s.step, on_decision=seen,
                                  arena=s.host_trees)
        passes = _cost_passes(s, plan, seen)
    return plan_tree(draft_fn, [s.root], tree=s.tree, sampling=s.sampling, prefix_len=[s.prefix_len],
                     seed=s.seed, step=s.step, passes=passes, instruments=instruments, backend=s.backend,
                     device=s.plan_device)


def _start_draft(s: DecodeState) -> None:
    """Start the draft on what is committed before the next root, and that root: the prompt
    before the first step, or the prompt and the first token after a served step 0 (the
    target's prompt features then cover every prompt token)."""
    if s.draft is not None:
        s.draft.start(s.prompt + s.result.tokens)
        s.draft.take_prompt_features(s.target)


def _cut_emitted(emitted, remaining: int, eos) -> tuple[list[int], str | None]:
    """A step's emitted tokens cut to the ``remaining`` budget, then just after the first EOS
    (``stop='eos'``, else None). Truncate first: an EOS past the budget is not emitted, so it
    does not stop the decode."""
    out = list(emitted)[:remaining]
    for j, tok in enumerate(out):
        if tok in eos:
            return out[: j + 1], "eos"
    return out, None


def _cost_plan(s, st: StepStats):
    """This step's frozen ``CostPlan`` (from the calibration so far) and the observer that
    records the prune's decision in ``st``."""
    def seen(d):
        st.predicted_tokens, st.predicted_ms = d.expected, d.predicted_ms

    return CostPlan.from_calibration(s.cost.timings, s.calibration, depths=s.tree.depth), seen


def _cost_passes(s, plan: CostPlan, seen):
    """The decode's lowered pass list (``s.lowered``) with the cost-aware passes around it
    (``plan`` and ``seen``: ``_cost_plan``). The list is lowered, so the cost gate wraps the
    backend's fast expand; the gates and the prune decide with the backend's ``decide``
    (numba: one kernel call; otherwise the reference in ``planner/cost_prune``)."""
    numba = s.backend == "numba"
    return cost_pipeline(plan, s.lowered, on_decision=seen, decide=numba_decide if numba else None,
                         frontiers=numba_frontiers if numba else None)


def draft_answer(drf: DraftModel, tree: DraftTree, nodes) -> torch.Tensor | SubsetLogits:
    """What the planner's ``expand`` gets from ``drf`` for ``nodes`` of tree 0:
    ``node_logits`` as ``[1, n, V]``, or, for a draft over part of the vocabulary
    (``vocab_ids`` set), its ``vocab_logits`` as ``SubsetLogits`` (the same law on its own
    columns: no scatter to, softmax over or top-S of the whole vocabulary)."""
    vocab = drf.vocab_ids
    out = drf.node_logits(tree, nodes) if vocab is None else drf.vocab_logits(tree, nodes)
    if out.shape[0] != len(nodes):
        raise ValueError(f"draft returned {out.shape[0]} rows for {len(nodes)} nodes")
    return out.unsqueeze(0) if vocab is None else SubsetLogits(out.unsqueeze(0), vocab)


def _decode(s: DecodeState) -> DecodeResult:
    tgt, drf, result = s.target, s.draft, s.result
    bar = tqdm(total=s.max_new_tokens, unit="tok", desc="decode") if s.progress else None
    t_start = time.perf_counter()
    served = tgt.start_and_root(s.prompt)  # the prompt's forward serves step 0 (None: it cannot)
    if served is None:
        tgt.start(s.prompt)  # step 0 verifies the prompt's last token as its root
        _start_draft(s)
    while s.remaining > 0:
        st = StepStats(0, 0, 0, 0, 0)
        t0 = time.perf_counter()
        if served is not None:
            # step 0 is a plain step whose root the prefill ran: no plan, no forward, no commit
            t, fw = _root_only(s.root, s.prefix_len, s.tree, s.plan_device), served
            st.drafted = False
            if s.cost is not None:  # one token, at no cost of its own (the prefill is not a step)
                st.predicted_tokens, st.predicted_ms = 1.0, 0.0
        else:
            t = _plan(s, st)
        t1 = time.perf_counter()
        st.t_plan = t1 - t0 - st.t_draft
        if served is None:
            fw = tgt.forward_tree(t.linear)
        t2 = time.perf_counter()
        # A context-dependent law (repetition penalty, caller processors) sees each node's
        # own context: every committed token (prompt + emitted, the root last) + the path.
        history = s.prompt + result.tokens if (s.sampling.needs_context or s.processors) else None
        res = verify_tree(t, fw, s.sampling, s.tree.verifier, s.streams, s.step, s.backend,
                          history=history, processors=s.processors)
        t3 = time.perf_counter()
        emitted, stop = _cut_emitted(res.emitted, s.remaining, s.eos)
        st.tree_size = res.tree_size
        st.accepted = len(res.path) - 1
        st.emitted = len(emitted)
        st.trials = res.trials
        st.visited = res.visited
        st.t_verify_forward, st.t_walk = t2 - t1, t3 - t2
        st.t_project = fw.projection_seconds  # (TreeLogits: 0 where logits cost nothing)
        if s.calibration is not None and st.drafted:
            s.calibration.update(t, res.path)  # known only now: it shapes later steps' trees
            if st.predicted_tokens is not None:
                s.calibration.record_step(max(0.0, st.predicted_tokens - 1), st.accepted)
        result.tokens += emitted
        if result.first_token_seconds is None and emitted:
            result.first_token_seconds = time.perf_counter() - t_start
        if bar is not None:
            bar.update(len(emitted))
        if s.callback is not None:
            s.callback(emitted)
        if stop is None and s.remaining > 0:
            t4 = time.perf_counter()
            if served is not None:
                # the target cached the root in its prefill; the draft starts on prompt + token
                _start_draft(s)
            else:
                tgt.commit(list(res.path))
                if drf is not None:
                    feats = [fw.features(i) for i in res.path]
                    drf.commit(t, list(res.nodes), list(res.emitted), feats)
            st.t_commit = time.perf_counter() - t4
        st.t_step = time.perf_counter() - t0
        result.steps.append(st)
        if stop is not None:
            result.stopped_by = stop
            break
        s.root, s.prefix_len, s.step = res.emitted[-1], s.prefix_len + len(res.path), s.step + 1
        served = None
    result.seconds = time.perf_counter() - t_start
    result.calibration = s.calibration
    if bar is not None:
        bar.close()
    return result


# -- batched decoding ---------------------------------------------------------------------------


def _is_batch(prompt_ids, attention_mask) -> bool:
    """Whether ``prompt_ids`` is the batch form: a list of sequences, or a 2-D tensor with a
    mask or with more than one row (a ``[1, n]`` tensor without mask stays one sequence)."""
    if isinstance(prompt_ids, torch.Tensor):
        return prompt_ids.dim() == 2 and (attention_mask is not None or prompt_ids.shape[0] > 1)
    if isinstance(prompt_ids, (list, tuple)) and prompt_ids:
        return not isinstance(prompt_ids[0], numbers.Integral)
    return False


def _check_prompts(prompt_ids, attention_mask, vocab_size: int) -> list[list[int]]:
    """The batch's prompts as lists of ints, each checked like a single prompt (errors name
    the row)."""
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dtype.is_floating_point or prompt_ids.dtype == torch.bool or prompt_ids.is_complex():
            raise TypeError(f"prompt_ids has dtype {prompt_ids.dtype}: allowed an integer tensor of token ids")
        B, n = prompt_ids.shape
        if attention_mask is None:
            raise ValueError(f"prompt_ids is a [{B}, {n}] tensor without attention_mask, so its padding "
                             "is unknown: allowed a [B, n] tensor with attention_mask= (1 at each row's "
                             "tokens, 0 at padding), or a list of token-id lists (rows may differ in length)")
        mask = attention_mask
        if not isinstance(mask, torch.Tensor):
            try:
                mask = torch.as_tensor(mask)
            except (TypeError, ValueError) as e:
                raise TypeError(f"attention_mask={attention_mask!r}: allowed a [B, n] tensor of 0/1 ({e})")
        if tuple(mask.shape) != (B, n):
            raise ValueError(f"attention_mask has shape {tuple(mask.shape)}: allowed the shape of "
                             f"prompt_ids, ({B}, {n})")
        if mask.dtype.is_floating_point or mask.is_complex():
            raise TypeError(f"attention_mask has dtype {mask.dtype}: allowed an integer or bool tensor of 0/1")
        mask = mask.to(torch.int64).cpu()
        bad = ((mask != 0) & (mask != 1)).nonzero()
        if bad.numel():
            r, c = bad[0].tolist()
            raise ValueError(f"attention_mask row {r} holds {int(mask[r, c])} at column {c}: allowed 0 or 1")
        ids = prompt_ids.cpu()
        rows = []
        for b in range(B):
            on = mask[b].nonzero().flatten()
            if on.numel() == 0:
                raise ValueError(f"prompt_ids row {b} is empty (attention_mask row {b} is all 0): allowed "
                                 "at least one token per row")
            lo, hi = int(on[0]), int(on[-1]) + 1
            if hi - lo != on.numel():
                raise ValueError(f"attention_mask row {b} has padding between tokens (columns "
                                 f"{lo}..{hi - 1} are not all 1): allowed left or right padding only")
            rows.append(ids[b, lo:hi])
        prompt_ids = rows
    elif attention_mask is not None:
        raise ValueError("attention_mask is set but prompt_ids is a list: allowed attention_mask only "
                         "with a padded [B, n] tensor (a list's rows carry their own lengths)")
    out = []
    for b, row in enumerate(prompt_ids):
        try:
            out.append(_check_prompt(row, vocab_size))
        except (TypeError, ValueError) as e:
            raise type(e)(f"prompt_ids row {b}: {e}") from None
    return out


def _check_max_new_rows(max_new_tokens, B: int) -> list[int]:
    if isinstance(max_new_tokens, (list, tuple)):
        if len(max_new_tokens) != B:
            raise ValueError(f"max_new_tokens has {len(max_new_tokens)} entries for {B} prompt rows: "
                             f"allowed an int or one int per row ({B})")
        return [_check_int(f"max_new_tokens[{b}] (row {b})", n, 1) for b, n in enumerate(max_new_tokens)]
    return [_check_int("max_new_tokens", max_new_tokens, 1)] * B


def _check_stream_ids(stream_ids, B: int) -> list[int]:
    if stream_ids is None:
        return list(range(B))
    if isinstance(stream_ids, (str, bytes)) or not hasattr(stream_ids, "__iter__"):
        raise TypeError(f"stream_ids={stream_ids!r} is a {type(stream_ids).__name__}: allowed None or one "
                        "int per row")
    keys = list(stream_ids)
    if len(keys) != B:
        raise ValueError(f"stream_ids has {len(keys)} entries for {B} prompt rows: allowed one id per row")
    for b, k in enumerate(keys):
        _check_int(f"stream_ids[{b}] (row {b})", k, 0)
        if k >= 2**32:
            raise ValueError(f"stream_ids[{b}]={k} (row {b}) is out of range: allowed [0, 2**32)")
    if len(set(keys)) != B:
        dup = next(k for k in keys if keys.count(k) > 1)
        raise ValueError(f"stream_ids repeats {dup}: allowed distinct ids (rows sharing a stream "
                         "would draw the same numbers)")
    return [int(k) for k in keys]


def _free_memory(device) -> int | None:
    """Bytes free on ``device`` (CUDA: the driver's count; CPU: available RAM), or None."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return int(free)
    if dev.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    return None


def _check_memory(tgt: TargetModel, drf: DraftModel | None, prompts: list[list[int]], limits: list[int],
                  budget: int | None, max_batch: int) -> None:
    """Refuse a batch whose estimated memory (``memory_estimate`` of the target and of the
    draft: KV caches of the padded batch with room for holes, one forward's activations)
    exceeds what the target's device has free, before any model work."""
    tree_len = 1 + (budget or 0)
    # widest row: prompt + new tokens + one tree; holes may double it before a compaction
    width = 2 * max(len(p) + n for p, n in zip(prompts, limits)) + tree_len
    parts = [tgt.memory_estimate(max_batch, width, tree_len)]
    if drf is not None:
        parts.append(drf.memory_estimate(max_batch, width, tree_len))
    if all(p is None for p in parts):
        return
    need = sum(p for p in parts if p is not None)
    free = _free_memory(tgt.device)
    if free is not None and need > free:
        per_row = max(1, need // max_batch)
        what = (f"prompt_ids has {len(prompts)} rows" if max_batch == len(prompts) else
                f"max_batch_size={max_batch}")
        raise ValueError(f"{what}: the batch needs about {need / 2**30:.2f} GiB "
                         f"(KV caches + activations of the target and the draft, estimated from the "
                         f"model configs) but "
                         f"{free / 2**30:.2f} GiB are free on {tgt.device or 'cpu'}: allowed at most "
                         f"{free // per_row} rows at these prompt lengths and max_new_tokens")


@dataclass
class _Row:
    """One prompt of a batch and where its decode is."""

    index: int  #: position in the caller's batch (its result's index)
    prompt: list[int]
    limit: int  #: max_new_tokens of this row
    key: int  #: stream id
    step: int = 0  #: this row's own steps so far (the ``step`` word of its counters)
    #: ``decode_requests``: the request's ``cancelled`` event (checked before every step)
    cancelled: threading.Event | None = None
    root: int = field(init=False)
    prefix_len: int = field(init=False)
    result: DecodeResult = field(default_factory=lambda: DecodeResult(tokens=[]))

    def __post_init__(self) -> None:
        self.root, self.prefix_len = self.prompt[-1], len(self.prompt) - 1

    @property
    def remaining(self) -> int:
        return self.limit - len(self.result.tokens)


@dataclass
class BatchState:
    """A batched decode: its checked inputs and where the loop is (``DecodeState`` for B rows)."""

    target: TargetModel
    draft: DraftModel | None
    prompts: list[list[int]]
    limits: list[int]
    keys: list[int]
    sampling: SamplingConfig
    tree: TreeConfig
    seed: int
    eos: frozenset[int] = frozenset()
    passes: Sequence | None = None
    backend: str = "numba"
    dump_ir: Path | None = None
    dump_steps: Collection[int] | None = (1,)
    progress: bool = False
    callback: Callable[[int, list[int]], None] | None = None  #: ``callback(row, new_tokens)``
    processors: tuple = ()
    cost: CostModel | None = None
    calibration: Calibration | None = None
    max_batch: int | None = None  #: rows decoding at once (None: all); the others wait
    #: a forward's fixed cost in tokens (``Timings.forward_overhead_tokens``): prompts are
    #: prefilled in ``prefill_groups`` where the target takes groups (None: one forward)
    prefill_overhead: float | None = None
    streams: Streams = field(init=False)
    rows: list[_Row] = field(init=False)  #: every row, in the caller's order
    step: int = 0  #: batch steps so far (names dumped IR; each row counts its own steps)
    #: prompts wait to join as rows finish (continuous batching): no row waits for the slowest
    rows_waiting: bool = False
    lowered: list = field(init=False)  #: as ``DecodeState.lowered``
    fused_plan: bool = field(init=False)  #: as ``DecodeState.fused_plan``
    host_trees: HostTreeArena = field(init=False, default_factory=HostTreeArena)  #: as ``DecodeState.host_trees``

    def __post_init__(self) -> None:
        self.streams = Streams(self.seed)
        self.lowered = lower(DEFAULT_PIPELINE if self.passes is None else self.passes, self.backend)
        self.fused_plan = self.backend == "numba" and self.passes is None and debug_level() == 0
        self.rows = [_Row(i, p, n, k) for i, (p, n, k) in enumerate(zip(self.prompts, self.limits, self.keys))]
        if self.max_batch is None:
            self.max_batch = len(self.rows)
        if self.cost is not None and self.calibration is None:
            self.calibration = self.cost.fresh_calibration(self.sampling.temperature)


def prefill_overhead(cost_model: CostModel | None) -> float | None:
    """``BatchState.prefill_overhead`` for a batched decode with ``cost_model`` (with or
    without a draft): a forward's fixed cost in tokens, or None (one prefill forward)."""
    return None if cost_model is None else cost_model.timings.forward_overhead_tokens()


def _rows_plan(s: BatchState, live: list[_Row]) -> BatchPlan | None:
    """The tree several live rows draft this step (``CostModel.plan_rows``: the depth and
    width that pay most at this many rows, with the continuation rates per width
    calibrated so far, for the slowest row where no prompt waits to join: a static batch
    waits for it), or None where no tree beats a plain step (16 rows on a 2-core CPU: the
    verify forward is compute-bound). Depends only on frozen latencies, past steps and
    whether prompts wait to join.

    Why one shape for every row, not the cost passes' per-step trees (one row's): at 4
    rows on the 2-core machine (SmolLM2, two queues of 20 held-out prompts, 4 rows live)
    small fixed trees ran 1.12x / 1.23x ``generate`` at T = 0 / 1, the cost passes' trees
    at margin 1.0 1.05x / 1.18x, plain steps 1.01x / 1.13x: the cost passes decide after
    the draft call whether a tree pays (a dropped tree has paid its call), and the deep
    trees they keep for some rows cost a batch's draft call and bookkeeping per depth
    (docs/results.md, "Twenty-sixth round")."""
    ctx = max(r.prefix_len for r in live)
    tree = s.tree
    plan = s.cost.plan_rows(len(live), ctx=ctx, max_depth=tree.depth, max_width=min(tree.frontier, tree.budget),
                            calibration=s.calibration, rows_waiting=s.rows_waiting)
    return None if plan.depth == 0 else plan


def _plan_rows(s: BatchState, live: list[_Row], st: StepStats) -> DraftTree:
    """This step's linearised trees, tree ``b`` for ``live[b]``; draft time goes to ``st``.
    One live row plans as a single sequence does (the cost passes, every step); several
    draft the a-priori plan's tree (``_rows_plan``) or take a plain step."""
    roots = [r.root for r in live]
    prefix = [r.prefix_len for r in live]
    keys = [r.key for r in live]
    steps = [r.step for r in live]
    tree, passes = s.tree, s.lowered
    plan = None
    if s.draft is not None and s.cost is not None and len(live) > 1:
        plan = _rows_plan(s, live)
        if plan is not None:
            tree = tree.with_(depth=plan.depth, frontier=plan.width, budget=plan.budget)
            st.predicted_tokens = plan.expected_tokens * len(live)
            st.predicted_ms = plan.predicted_ms
    if s.draft is None or (s.cost is not None and len(live) > 1 and plan is None):
        st.drafted = False
        if s.cost is not None:
            st.predicted_tokens = 1.0
            st.predicted_ms = s.cost.timings.ar_step_batch(len(live), max(prefix))
        return root_only_rows(roots, prefix, s.tree)
    drf = s.draft
    cost_plan = _cost_plan(s, st) if plan is None and s.cost is not None else None

    def draft_fn(tr, nodes):
        t_d = time.perf_counter()
        valid = nodes >= 0
        lists = [row[row >= 0].tolist() for row in nodes]
        # A draft over part of the vocabulary answers on its own columns (SubsetLogits, as
        # draft_answer does at batch 1): no [B, n, V] scatter, softmax or top-S over V.
        vocab = drf.vocab_ids
        outs = drf.node_logits_rows(tr, lists) if vocab is None else drf.vocab_logits_rows(tr, lists)
        st.t_draft += time.perf_counter() - t_d
        for b, (o, want) in enumerate(zip(outs, lists)):
            if o.shape[0] != len(want):
                raise ValueError(f"draft returned {o.shape[0]} rows for {len(want)} nodes of row {b}")
        if bool(valid.all()):  # every row asked for as many nodes (one row always): no padding
            out = torch.stack(outs).to(torch.float32)
        else:
            V = drf.vocab_size if vocab is None else len(vocab)
            out = torch.zeros(nodes.shape[0], nodes.shape[1], V, device=outs[0].device if outs else "cpu")
            for b, (o, want) in enumerate(zip(outs, lists)):
                if want:
                    out[b, valid[b].to(out.device)] = o.to(out.dtype)
        return out if vocab is None else SubsetLogits(out, vocab.to(out.device))

    instruments = []
    if s.dump_ir is not None and (s.dump_steps is None or s.step in s.dump_steps):
        instruments.append(DumpIR(s.dump_ir))
    if cost_plan is not None:  # one live row: the cost passes, fused where nothing watches them
        if s.fused_plan and not instruments:
            return plan_cost_tree(draft_fn, roots, tree=tree, sampling=s.sampling, plan=cost_plan[0], prefix_len=prefix,
                                  seed=s.seed, step=steps, stream_keys=keys, on_decision=cost_plan[1],
                                  arena=s.host_trees)
        passes = _cost_passes(s, *cost_plan)
    return plan_tree(draft_fn, roots, tree=tree, sampling=s.sampling, prefix_len=prefix, seed=s.seed,
                     step=steps, passes=passes, instruments=instruments, backend=s.backend, stream_keys=keys)


def _join_rows(s: BatchState, rows: list[_Row], n_live: int, bar, t_start: float):
    """Start ``rows`` on both models, after ``n_live`` live rows (continuous batching) or as
    a fresh batch (``n_live == 0``). Where the target serves their first tokens from the
    prompts' forward (``start_rows_and_roots`` / ``add_rows_and_roots``), each row draws its
    first token now (its step 0, with no tree and no forward of its own) and the draft
    starts on prompt + that token; else step 0 verifies the last prompt token. Returns
    (rows still decoding, rows that finished at their first token)."""
    tgt, drf = s.target, s.draft
    joined = time.perf_counter() - t_start
    for r in rows:
        r.result.joined_seconds = joined
    prompts = [r.prompt for r in rows]
    kw = {}
    if s.prefill_overhead is not None and len(rows) > 1 and tgt.prefills_in_groups:
        # prompts of similar lengths share a forward: less left padding than one forward
        # padded to the longest prompt, at the price of more forwards (measured per machine)
        kw["groups"] = prefill_groups([len(p) for p in prompts], s.prefill_overhead)
    served = tgt.add_rows_and_roots(prompts, **kw) if n_live else tgt.start_rows_and_roots(prompts, **kw)
    going = list(range(len(rows)))
    if served is None:
        (tgt.add_rows if n_live else tgt.start_rows)(prompts, **kw)
    else:
        t0 = time.perf_counter()
        t = root_only_rows([r.root for r in rows], [r.prefix_len for r in rows], s.tree)
        st0 = StepStats(0, 0, 0, 0, 0)
        st0.drafted = False
        if s.cost is not None:  # one token, at no cost of its own (the prefill is not a step)
            st0.predicted_tokens, st0.predicted_ms = 1.0, 0.0
        walks, stops, stats = _walk_rows(s, rows, t, served, st0, bar)
        t1 = time.perf_counter()
        for st in stats:
            st.t_plan, st.t_walk = 0.0, t1 - t0
        _advance_rows(s, rows, walks, stops, stats, t0, t_start)
        going = [b for b, stop in enumerate(stops) if stop is None]
        if len(going) < len(rows) and (going or n_live):
            tgt.keep_rows(list(range(n_live)) + [n_live + b for b in going])
    if drf is not None and going:
        starts = [rows[b].prompt + rows[b].result.tokens for b in going]
        (drf.add_rows if n_live else drf.start_rows)(starts)
        drf.take_prompt_features_rows(tgt, list(range(n_live, n_live + len(going))) if n_live else None)
    return [rows[b] for b in going], [r for b, r in enumerate(rows) if b not in going]


def _walk_rows(s: BatchState, live: list[_Row], t: DraftTree, fws: list, st0: StepStats, bar):
    """Every row's walk of its verified tree (``fws[b]`` for tree ``b``), its tokens emitted
    (cut at its budget and EOS; callback, progress bar) and its calibration updated.
    Returns (walks, stops, stats): per row its walk, why it stopped (None: it goes on) and
    its ``StepStats`` (a copy of ``st0`` with the walk's counts)."""
    walks, stops, stats = [], [], []
    sizes = t.linear.n.tolist()  # one host read: a root-only row's likely walk is its root
    # every row's likely walk projected in one call (not B lm_head reads)
    paths = [[0] if n == 1 else likely_path(t, b) for b, n in enumerate(sizes)]
    s.target.prefetch_rows(fws, paths)
    with_ctx = s.sampling.needs_context or bool(s.processors)
    greedy = (_greedy_rows(fws, paths, sizes, s.sampling, s.backend) if s.sampling.greedy and not with_ctx
              else None)
    # rows with nothing drafted draw their token together (one softmax over [R, V])
    roots = [] if with_ctx else [b for b, n in enumerate(sizes) if n == 1]
    root_walks = dict(zip(roots, verify_roots(t, [fws[b] for b in roots], roots, s.sampling, s.streams,
                                              [live[b].step for b in roots], [live[b].key for b in roots],
                                              s.backend)))
    for b, row in enumerate(live):
        ctx = row.prompt + row.result.tokens if with_ctx else None
        res = root_walks.get(b) or verify_tree(t, fws[b], s.sampling, s.tree.verifier, s.streams, row.step,
                                               s.backend, history=ctx, processors=s.processors, b=b,
                                               key=row.key, prefetched=True,
                                               greedy=None if greedy is None else greedy[b])
        emitted, stop = _cut_emitted(res.emitted, row.remaining, s.eos)
        if stop is None and len(emitted) >= row.remaining:
            stop = "max_new_tokens"
        st = copy.copy(st0)  # (dataclasses.replace re-runs __init__: ~4x the time, per row and step)
        st.tree_size, st.accepted, st.emitted = res.tree_size, len(res.path) - 1, len(emitted)
        st.trials, st.visited = res.trials, res.visited
        if s.calibration is not None and st0.drafted:
            s.calibration.update(t, res.path, b)
        row.result.tokens += emitted
        if bar is not None:
            bar.update(len(emitted))
        if s.callback is not None:
            s.callback(row.index, emitted)
        walks.append(res)
        stops.append(stop)
        stats.append(st)
    project = sum(fw.projection_seconds for fw in fws)  # the batch's, as t_walk is
    for st in stats:
        st.t_project = project
    return walks, stops, stats


def _greedy_rows(fws: list, paths: list[list[int]], sizes: list[int], sampling,
                 backend: str) -> list[dict[int, int]]:
    """Per row, the greedy token of each node of its likely path (``paths[b]``, projected
    already), for rows with a drafted tree: one ``greedy_tokens`` pass over all of them
    instead of one per visited node and row (a 4-row step visits ~7; each read of 49,152
    logits cost ~70 us warm), by the numba scan (``kernels.argmax``) unless ``backend``
    is 'reference'. The check for broken logits covers every node read.

    Where every node read is a row of one projection's output (``prefetch_rows``' one
    call), the pick runs on that output as it is (``greedy_tokens(rows=)``) instead of on a
    stack of the rows: no copy of 8-12 x 49,152 floats into fresh memory a 4-row step."""
    items = [(b, i) for b, (n, p) in enumerate(zip(sizes, paths)) if n > 1 for i in dict.fromkeys(p)]
    out: list[dict[int, int]] = [{} for _ in paths]
    if items:
        read = [fws[b].logits(i).cpu() for b, i in items]
        fast = None if backend == "reference" else first_max
        block = _rows_of_one_block(read)
        if block is None:
            toks = greedy_tokens(torch.stack(read), sampling, first_max=fast).tolist()
        else:
            toks = greedy_tokens(block[0], sampling, first_max=fast, rows=block[1]).tolist()
        for (b, i), x in zip(items, toks):
            out[b][i] = x
    return out


def _rows_of_one_block(rows: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]] | None:
    """``(block, at)`` where every tensor of ``rows`` is a whole row of one contiguous
    2-D ``block`` (``rows[k] is block[at[k]]`` as data), else None."""
    base = rows[0]._base
    if base is None or base.dim() != 2 or not base.is_contiguous():
        return None
    V, start = base.shape[1], base.storage_offset()
    at = []
    for r in rows:
        off = r.storage_offset() - start
        if r._base is not base or r.dim() != 1 or r.shape[0] != V or r.stride(0) != 1 or off % V:
            return None
        at.append(off // V)
    return base, at


def _advance_rows(s: BatchState, live: list[_Row], walks, stops, stats, t0: float, t_start: float) -> None:
    """Record each row's step (begun at ``t0``) and finish the rows that stopped; the others
    move their root, prefix and step on."""
    now = time.perf_counter()
    for b, row in enumerate(live):
        st = stats[b]
        st.t_step = now - t0
        row.result.steps.append(st)
        if row.result.first_token_seconds is None and row.result.tokens:
            row.result.first_token_seconds = now - t_start
        if stops[b] is not None:
            row.result.stopped_by = stops[b]
            row.result.seconds = now - t_start
            row.result.calibration = s.calibration
        else:
            row.root = walks[b].emitted[-1]
            row.prefix_len += len(walks[b].path)
            row.step += 1


def _decode_rows(s: BatchState) -> list[DecodeResult]:
    waiting = list(s.rows)  # join in order as rows finish

    def take(k: int) -> list[_Row]:
        nonlocal waiting
        out, waiting = waiting[:k], waiting[k:]
        return out

    for _ in run_rows(s, take, total=sum(s.limits), more=lambda: bool(waiting)):
        pass
    return [r.result for r in s.rows]


def run_rows(s: BatchState, take: Callable[[int], list[_Row]], total: int | None = None,
             more: Callable[[], bool] = lambda: False):
    """The batched loop: rows come from ``take(k)`` (at most ``k`` rows that wait, in the
    order they join; fewer or none when none wait), up to ``s.max_batch`` live at once; a
    finished row is yielded (its ``result`` complete) and ``take`` fills its place.
    ``total``: the progress bar's total tokens, when known; ``more()``: whether rows may
    still join (``BatchState.rows_waiting``, read before every step)."""
    tgt, drf = s.target, s.draft
    bar = tqdm(total=total, unit="tok", desc="decode") if s.progress else None
    t_start = time.perf_counter()

    def fill(live: list[_Row]):
        # continuous batching: waiting prompts take the free rows, after the live ones;
        # rows that finish at their first token are yielded at once and free their place
        while len(live) < s.max_batch:
            new = take(s.max_batch - len(live))
            if not new:
                return
            # each event read once: another thread may set it between two reads, and a row
            # must then either join or leave, never neither
            off = [_is_cancelled(r) for r in new]
            for r, o in zip(new, off):
                if o:  # cancelled while waiting: no prefill, no token
                    _finish_cancelled(s, r, t_start)
                    yield r
            new = [r for r, o in zip(new, off) if not o]
            if new:
                started, finished = _join_rows(s, new, len(live), bar, t_start)
                live += started
                yield from finished

    def drop_cancelled(live: list[_Row]) -> list[_Row]:
        # requests cancelled since the last step leave before this one (their cache rows
        # too); returns those that left
        off = [_is_cancelled(r) for r in live]  # read once (as in fill)
        if not any(off):
            return []
        keep = [b for b, o in enumerate(off) if not o]
        gone = [r for r, o in zip(live, off) if o]
        for r in gone:
            _finish_cancelled(s, r, t_start)
        if keep:
            tgt.keep_rows(keep)
            if drf is not None:
                drf.keep_rows(keep)
        live[:] = [live[b] for b in keep]
        return gone

    try:  # the caller may stop iterating early (decode_requests): the bar is closed anyway
        live: list[_Row] = []
        yield from fill(live)
        while live:
            gone = drop_cancelled(live)
            if gone:
                yield from gone
                yield from fill(live)
                continue
            st0 = StepStats(0, 0, 0, 0, 0)
            t0 = time.perf_counter()
            s.rows_waiting = more()
            t = _plan_rows(s, live, st0)
            t1 = time.perf_counter()
            st0.t_plan = t1 - t0 - st0.t_draft
            fws = tgt.forward_trees(t.linear)
            t2 = time.perf_counter()
            walks, stops, stats = _walk_rows(s, live, t, fws, st0, bar)
            t3 = time.perf_counter()
            # the scale corrects the cost passes' per-node estimates: one live row's steps only
            # (several draft the plan's tree, whose rates are measured per width)
            if s.calibration is not None and st0.drafted and st0.predicted_tokens is not None and len(live) == 1:
                s.calibration.record_step(max(0.0, st0.predicted_tokens - len(live)),
                                          sum(st.accepted for st in stats))
            going = [b for b, stop in enumerate(stops) if stop is None]
            if going:
                # every row commits (a finished row's commit is harmless), then the finished rows leave
                tgt.commit_rows([list(w.path) for w in walks])
                if drf is not None:
                    drf.commit_rows(t, [list(w.nodes) for w in walks], [list(w.emitted) for w in walks],
                                    [[fws[b].features(i) for i in w.path] for b, w in enumerate(walks)])
                if len(going) < len(live):
                    keep = list(range(len(going))) if active("batch_keep_first_rows") else going
                    tgt.keep_rows(keep)
                    if drf is not None:
                        drf.keep_rows(keep)
            t4 = time.perf_counter()
            for st in stats:
                st.t_verify_forward, st.t_walk, st.t_commit = t2 - t1, t3 - t2, t4 - t3
            _advance_rows(s, live, walks, stops, stats, t0, t_start)
            for b in range(len(live)):
                if stops[b] is not None:
                    yield live[b]
            live = [live[b] for b in going]
            s.step += 1
            yield from fill(live)
    finally:
        if bar is not None:
            bar.close()


def _is_cancelled(row: _Row) -> bool:
    return row.cancelled is not None and row.cancelled.is_set()


def _finish_cancelled(s: BatchState, row: _Row, t_start: float) -> None:
    """End ``row``'s result as cancelled (``decode_requests``), with what it emitted so far."""
    row.result.stopped_by = "cancelled"
    row.result.seconds = time.perf_counter() - t_start
    row.result.calibration = s.calibration


_WARM: set[str] = set()


def _warm_up(backend: str) -> None:
    """Compile the backend's kernels before the decode clock starts: the first call in a
    process plans one tiny tree (numba compiles in a few seconds on a fresh install and
    caches on disk; Triton compiles each kernel on first launch), so the first step's
    statistics measure the step, not the compiler."""
    if backend == "reference" or backend in _WARM:
        return
    if backend == "triton" and not torch.cuda.is_available():
        return  # the interpreter compiles nothing
    dev = "cuda" if backend == "triton" else "cpu"
    tiny = TreeConfig(depth=2, frontier=2, slots=3, budget=4, rheostat=1, support=8)
    t = plan_tree(lambda t, nodes: torch.zeros(nodes.shape[0], nodes.shape[1], 16, device=dev), [0], tree=tiny,
                  sampling=SamplingConfig(), backend=backend, device=dev)
    if backend == "numba":  # the cost passes' decision kernel too
        flat = Timings((1, 64), (1.0, 1.0), (1.0, 1.0), 0, 1000, (1,), (1.0,), 0.0, 0.0)
        numba_decide(CostPlan.from_calibration(flat, Calibration()), t, tiny.budget)
    _WARM.add(backend)
