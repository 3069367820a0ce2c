"""Measure at load what the planner needs to know about this machine: the fastest target
dtype (``choose_dtype``) and the cost model's latencies (``measure_timings``).

Both are measured with short real forwards, once per machine + torch version + threads +
model (+ dtype and draft for the latencies), and cached as small JSON files under
``rheoplan.costmodel.cache_dir()`` (``~/.cache/rheoplan/`` by default); later loads read
the cache. Measure again (e.g. after a run on a busy machine) with ``RHEOPLAN_REMEASURE=1``
or by deleting the files. Nothing here guesses from CPU flags: a dtype is used because it was faster
here. Every measuring function takes a ``timer`` (default ``time.perf_counter``) so tests
can inject a clock.

Example (needs a model, so not run as a doctest):
    >>> model, tok = load_smollm2(torch.float32)                       # doctest: +SKIP
    >>> dtype, ms = choose_dtype(model, model_id="smollm2-135m")        # doctest: +SKIP
    >>> model = model.to(dtype)                                        # doctest: +SKIP
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from functools import partial
from typing import Callable, Mapping, Sequence

import torch
from tqdm.auto import tqdm

from rheoplan.config import SamplingConfig, TreeConfig
from rheoplan.costmodel import Timings, cache_dir, cache_key, cache_read, cache_write, interp, remeasure_requested
from rheoplan.decode import plan_and_decode
from rheoplan.ir import empty_tree
from rheoplan.models import as_draft, as_target, hashed_context_lm
from rheoplan.models._hf_common import base_model, crop_cache, new_cache, output_head, run_base_rows
from rheoplan.models.base import DraftModel
from rheoplan.models.eagle3.head import Eagle3Head
from rheoplan.models.hf_target import HFTarget
from rheoplan.models.lean_llama import fuse_glue
from rheoplan.models.packed_linear import PACKING_RULE, pack_where_it_pays, unpack_linears
from rheoplan.pipeline import PassContext
from rheoplan.plan import plan_tree
from rheoplan.planner.linearize import linearize

DTYPE_CACHE = "dtype.json"
HEAD_DTYPE_CACHE = "head_dtype.json"
#: how much faster than float32 another dtype must run a step's draft calls to be chosen: a
#: tie keeps float32 (no reason to round a head's weights further). (It was 1.2, on the
#: belief that a bfloat16 head accepts less: 1.84 against 1.93 and 1.78 against 1.84 tokens per
#: step in decodes of 10-12 prompts, within their sampling noise. The trainer's held-out
#: evaluation, which samples nothing, scores SmolLM2's shipped head alike in both dtypes:
#: acceptance proxy 48.06% / 48.05% at depth 1, 43.02% / 43.00% at depth 2; docs/results.md,
#: "The draft head's dtype timed as a decode runs it".)
HEAD_DTYPE_MARGIN = 1.05
TIMINGS_CACHE = "timings.json"
#: verify sizes measured (tree tokens, root included); ``Timings.verify`` interpolates
VERIFY_SIZES = (1, 2, 4, 8, 16, 32, 64)
#: how many tokens the dtype probe's verify tree carries (the CLI's default tree: root + 8)
PROBE_TREE = 9
#: the batched verify grid (``measure_batch_verify``): live rows B x tokens per row n;
#: small on purpose (15 forwards, 651 token rows in all), ``Timings.verify_batch`` interpolates
BATCH_SIZES = (1, 4, 16)
BATCH_ROW_SIZES = (1, 2, 4, 8, 16)

Timer = Callable[[], float]


def _read_cache() -> bool:
    """False when ``RHEOPLAN_REMEASURE`` is set: measure again (and overwrite the cache)."""
    return not remeasure_requested()


def median_ms(fn: Callable[[], object], *, reps: int, warmup: int = 1,
              timer: Timer = time.perf_counter) -> float:
    """Median wall time of ``fn()`` over ``reps`` calls after ``warmup`` untimed ones (ms).

    Example (an injected clock that advances 2 ms per call):
        >>> clock = [0.0]
        >>> def fn(): clock[0] += 0.002
        >>> round(median_ms(fn, reps=3, timer=lambda: clock[0]), 6)
        2.0
    """
    if reps < 1:
        raise ValueError(f"reps={reps} is out of range: allowed >= 1")
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t0 = timer()
        fn()
        out.append(1e3 * (timer() - t0))
    return statistics.median(out)


def round_robin_ms(calls: Sequence[Callable[[], object]], *, reps: int, warmup: int = 1,
                   timer: Timer = time.perf_counter, before: Callable[[], object] | None = None) -> list[float]:
    """Median wall time (ms) of each of ``calls`` over ``reps`` rounds of one call each,
    after ``warmup`` untimed calls of each. ``before``, if given, runs untimed before every
    call (warm-up ones too): what the caller's real use does between two calls.

    Round-robin, not one call's ``reps`` in a row: a hiccup of the machine (another process,
    a page fault) then spoils one sample of one call, which the median drops, instead of
    every sample of whichever call was being timed. A latency curve measured call by call
    once read 19.8 ms for a 2-token forward that takes 15 ms, and the running maximum
    (``monotone``) carried it up to 16 tokens: the cost model then saw 16-token trees as free
    and planned trees of 14 nodes instead of 10, 6% (T = 1) and 10% (T = 0) slower
    (docs/results.md, "Lean steps, tenth round").

    Example (an injected clock: call 0 takes 1 ms, call 1 takes 2 ms except once 50 ms):
        >>> clock, n = [0.0], [0]
        >>> def fast(): clock[0] += 0.001
        >>> def slow():
        ...     n[0] += 1
        ...     clock[0] += 0.050 if n[0] == 3 else 0.002
        >>> [round(v, 6) for v in round_robin_ms([fast, slow], reps=3, timer=lambda: clock[0])]
        [1.0, 2.0]
    """
    if reps < 1:
        raise ValueError(f"reps={reps} is out of range: allowed >= 1")
    for fn in calls:
        for _ in range(warmup):
            if before is not None:
                before()
            fn()
    samples: list[list[float]] = [[] for _ in calls]
    for _ in range(reps):
        for i, fn in enumerate(calls):
            if before is not None:
                before()
            t0 = timer()
            fn()
            samples[i].append(1e3 * (timer() - t0))
    return [statistics.median(x) for x in samples]


def fastest(candidates: Mapping[str, Callable[[], object]], *, reps: int = 5, warmup: int = 1,
            timer: Timer = time.perf_counter,
            before: Callable[[], object] | None = None) -> tuple[str, dict[str, float]]:
    """``(name, {name: median ms})`` of the fastest candidate; ties go to the first listed.

    Candidates are timed round-robin (``round_robin_ms``, ``before`` untimed before each
    call), so a machine that slows down during the probe slows every candidate alike.
    """
    if not candidates:
        raise ValueError("fastest() needs at least one candidate")
    names = list(candidates)
    ms = dict(zip(names, round_robin_ms([candidates[n] for n in names], reps=reps, warmup=warmup, timer=timer,
                                        before=before)))
    best = min(names, key=lambda n: (ms[n], names.index(n)))
    return best, ms


def supported_dtypes(device: torch.device | str) -> list[torch.dtype]:
    """Dtypes worth timing on ``device``: float32 and bfloat16 everywhere torch runs them,
    float16 on a GPU (on a CPU torch's float16 matmuls are emulated)."""
    dev = torch.device(device)
    out = [torch.float32, torch.bfloat16]
    if dev.type == "cuda":
        out.append(torch.float16)
        if not torch.cuda.is_bf16_supported():
            out.remove(torch.bfloat16)
    return out


def model_identity(model) -> str:
    """What a cache entry's model is: its config's name or path, type and parameter count."""
    cfg = getattr(model, "config", None)
    name = getattr(cfg, "_name_or_path", "") or type(model).__name__
    n = sum(p.numel() for p in model.parameters())
    return f"{name} ({getattr(cfg, 'model_type', '?')}, {n} params)"


def _forward(model, prompt_len: int, tokens: int) -> Callable[[], None]:
    """One ``tokens``-token verify forward (a chain; 1 = a plain decoding step) after a
    cached prompt of ``prompt_len`` tokens."""
    dev = next(model.parameters()).device
    tgt = HFTarget(model)
    prompt = [(7 * i + 3) % int(model.config.vocab_size) for i in range(prompt_len + 1)]
    tgt.start(prompt)
    lin = chain_linear(prompt[-1], prompt_len, tokens)

    def run() -> None:
        tgt.forward_tree(lin).prefetch([0])
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    return run


def chain_linear(root: int, prefix_len: int, n: int):
    """A linearised chain of ``n`` tokens (root included) after ``prefix_len`` cached ones:
    the shape of a verify forward for timing (its cost depends on the token count)."""
    if n == 1:
        t = empty_tree(1, 1, 1, 1, torch.tensor([root]), torch.tensor([prefix_len]), 1, 1)
        cfg = TreeConfig(depth=1, frontier=1, slots=1, budget=1, rheostat=1, support=1)
        return linearize(t, PassContext(tree_cfg=cfg, sampling=SamplingConfig())).linear
    cfg = TreeConfig(depth=n - 1, frontier=1, slots=1, budget=n - 1, rheostat=1, support=1)
    # a draft that always proposes token 0 (any valid id: only the token count matters)
    t = plan_tree(lambda tr, nodes: torch.zeros(nodes.shape[0], nodes.shape[1], 2), [root], tree=cfg,
                  sampling=SamplingConfig(), prefix_len=[prefix_len])
    return t.linear


#: what ``choose_dtype`` picks by: the forward each decoding step runs
PICK_BY = {"tree": f"the {PROBE_TREE}-token verify forward a drafted step runs",
           "one": "the 1-token forward an autoregressive step runs"}
#: dtypes whose deciding forward is within this factor of the fastest one tie, and the tie
#: goes to the smaller sum of both forwards. Why: on the AVX2-only AMD EPYC the two
#: dtypes' 9-token forwards came within the machine's noise of each other (float32 72.0
#: against bfloat16 72.9 ms in a slow spell, 61.0 against 54.2 at another load) while
#: bfloat16's 1-token forward was clearly faster (43.5 against 50.4), and the choice
#: flipped to float32 on 0.9 ms (docs/results.md, "A lone row by eights")
PICK_TIE = 1.05


def _check_pick_by(pick_by: str) -> None:
    if pick_by not in PICK_BY:
        raise ValueError(f"pick_by={pick_by!r} is not understood: allowed one of {sorted(PICK_BY)}")


def pick_dtype(ms: dict[str, list[float]], pick_by: str = "tree") -> tuple[str, bool]:
    """``(dtype name, tied)`` from ``{dtype name: [1-token ms, PROBE_TREE-token ms]}``: the
    fastest by ``pick_by``'s forward (``PICK_BY``); dtypes within ``PICK_TIE`` of it tie,
    and the tie goes to the smaller sum of both forwards (then the first listed).

    Example:
        >>> pick_dtype({"float32": [50.4, 72.0], "bfloat16": [43.5, 72.9]})
        ('bfloat16', True)
        >>> pick_dtype({"float32": [51.0, 78.0], "bfloat16": [61.0, 63.0]})
        ('bfloat16', False)
        >>> pick_dtype({"float32": [51.0, 78.0], "bfloat16": [61.0, 63.0]}, "one")
        ('float32', False)
    """
    _check_pick_by(pick_by)
    if not ms:
        raise ValueError("ms holds no dtype")
    col = 1 if pick_by == "tree" else 0
    names = list(ms)
    lead = min(ms[n][col] for n in names)
    tied = [n for n in names if ms[n][col] <= PICK_TIE * lead]
    return min(tied, key=lambda n: (sum(ms[n]), names.index(n))), len(tied) > 1


def choose_dtype(model, *, model_id: str | None = None, pick_by: str = "tree", reps: int = 5,
                 prompt_len: int = 64, timer: Timer = time.perf_counter, use_cache: bool = True,
                 log=sys.stderr) -> tuple[torch.dtype, dict[str, list[float]]]:
    """The fastest dtype for ``model`` on its device, by timing a 1-token forward and a
    ``PROBE_TREE``-token verify forward in each supported dtype, round-robin (a few
    seconds on a slow 2-core CPU, once: the times are cached).

    ``pick_by`` names the forward that decides (``PICK_BY``; a tie within ``PICK_TIE`` goes
    to the smaller sum of both, ``pick_dtype``): ``'tree'`` (speculative
    decoding: each step verifies a tree) or ``'one'`` (autoregressive decoding). They can
    disagree: on an Intel Xeon that exposes AMX, float32 ran the 1-token forward faster
    (51 against 61 ms) while bfloat16 ran 16 tokens in barely more time than one (67 ms,
    float32 101 ms), and rheoplan decoded 1.17x-1.28x faster in bfloat16 (two interleaved
    runs; docs/results.md, "dtype auto by the verify tree").

    ``model`` is loaded once (any dtype); the others are cast copies, freed afterwards.
    Returns ``(dtype, {dtype name: [median ms of the 1-token, of the PROBE_TREE-token
    forward]})``; the times are cached per machine + model, and a later load (with either
    ``pick_by``) picks from them.
    """
    _check_pick_by(pick_by)
    dev = next(model.parameters()).device
    mid = model_id or model_identity(model)
    # every dtype is timed with packed linear weights and few-row products where each pays
    # (the loader runs them so); the key names it and that the two forwards are timed apart,
    # so records made before (one time for the pair; no few-row kernel) are measured again
    key = cache_key("dtype", f"{mid} ({PACKING_RULE}, float32 too; 1 and {PROBE_TREE} tokens apart)", dev)
    ms = _cached_forward_ms(key) if use_cache and _read_cache() else None
    where = " (cached)"
    if ms is None:
        ms = _time_dtypes(model, dev, prompt_len, reps, timer)
        where = f"; cached in {cache_write(DTYPE_CACHE, key, {'ms': ms})}" if use_cache else ""
    best, tied = pick_dtype(ms, pick_by)
    times = ", ".join(f"{n} {one:.1f} / {tree:.1f}" for n, (one, tree) in ms.items())
    tie = (f"; within {PICK_TIE:g}x of each other there, so by the sum of both forwards" if tied else "")
    print(f"dtype auto: {best}, by {PICK_BY[pick_by]}{tie} (ms per 1-token / {PROBE_TREE}-token forward: "
          f"{times}{where})", file=log)
    return getattr(torch, best), ms


def _cached_forward_ms(key: str) -> dict[str, list[float]] | None:
    """The per-dtype ``[1-token, PROBE_TREE-token]`` times stored under ``key``, or None
    when there are none (or the record is not of that shape)."""
    rec = cache_read(DTYPE_CACHE, key)
    ms = rec.get("ms") if isinstance(rec, dict) else None
    if not (isinstance(ms, dict) and ms and all(
            hasattr(torch, n) and isinstance(v, list) and len(v) == 2 for n, v in ms.items())):
        return None
    return {n: [float(x) for x in v] for n, v in ms.items()}


def _time_dtypes(model, dev, prompt_len: int, reps: int, timer: Timer) -> dict[str, list[float]]:
    """``{dtype name: [ms of a 1-token, of a PROBE_TREE-token forward]}`` for every supported
    dtype, all forwards timed round-robin (``fastest``) on cast copies, packed as the loader
    packs them; the caller's ``model`` comes back as it came."""
    own = next(model.parameters()).dtype
    cands = {}
    copies = []
    own_packed = False
    # every copy is cast before anything is packed (a packed weight cannot be deep-copied)
    for dt, m in [(dt, model if dt == own else copy.deepcopy(model).to(dt)) for dt in supported_dtypes(dev)]:
        n = pack_where_it_pays(m)[0]
        own_packed = own_packed or (m is model and n > 0)
        copies.append(m)
        name = str(dt).removeprefix("torch.")
        for n in (1, PROBE_TREE):
            cands[f"{name} {n}"] = _forward(m, prompt_len, n)
    try:
        with torch.no_grad():
            _, flat = fastest(cands, reps=reps, timer=timer)
    finally:
        if own_packed:  # the caller's model comes back as it came (the loader packs it after)
            unpack_linears(model)
    del copies, cands
    out: dict[str, list[float]] = {}
    for cand, t in flat.items():
        name, n = cand.split()
        out.setdefault(name, [0.0, 0.0])[0 if n == "1" else 1] = t
    return out


#: cached pairs in the head's k/v cache when a draft step is timed (a prompt and part of its answer)
HEAD_PROBE_CONTEXT = 256
#: committed pairs the timed root call fuses from target features (about what a step commits)
HEAD_PROBE_PENDING = 2


def _head_step(head: Eagle3Head, rows: int, context: int = HEAD_PROBE_CONTEXT) -> Callable[[], object]:
    """A decode step's draft calls, as ``Eagle3Draft`` makes them: the root call
    (``HEAD_PROBE_PENDING`` committed pairs, their target features through ``fc``) and one
    call of ``rows`` tree nodes fed the root's hidden, each over ``context`` cached pairs and
    through the draft-vocabulary projection."""
    if not isinstance(head, Eagle3Head):
        raise TypeError(f"head is a {type(head).__name__}: allowed an Eagle3Head")
    cfg = head.config
    p = next(head.parameters())
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(p.device, p.dtype)

    P, S = HEAD_PROBE_PENDING, context + HEAD_PROBE_PENDING
    past = (rand(cfg.num_key_value_heads, context, cfg.head_dim), rand(cfg.num_key_value_heads, context, cfg.head_dim))
    feats, root_emb, node_emb = rand(P, 3 * cfg.target_hidden_size), rand(P, cfg.hidden_size), rand(rows, cfg.hidden_size)
    root_pos = torch.arange(context, S, device=p.device)
    node_pos = torch.full((rows,), S, device=p.device)
    root_sees = torch.ones(P, S, dtype=torch.bool, device=p.device).tril(context)  # the cache, causal among the pairs
    node_sees = torch.cat([torch.ones(rows, S, dtype=torch.bool), torch.eye(rows, dtype=torch.bool)], 1).to(p.device)

    def step():
        with torch.no_grad():
            out, kv = head(root_emb, feats, root_pos, past, root_sees)
            head.draft_logits(out[-1:]).to(torch.float32)
            out, _ = head(node_emb, out[-1:].expand(rows, -1), node_pos, kv, node_sees)
            head.draft_logits(out).to(torch.float32)
    return step


def packed_copy(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A ``dtype`` copy of ``model`` (a head or a target whose weights are not packed) with
    its linear weights packed where that pays, as the loader runs it."""
    m = copy.deepcopy(model).to(dtype)
    pack_where_it_pays(m)
    return m


def choose_head_dtype(head: Eagle3Head, *, head_id: str, target: torch.nn.Module | None = None, rows: int = 3,
                      reps: int = 7, margin: float = HEAD_DTYPE_MARGIN, timer: Timer = time.perf_counter,
                      use_cache: bool = True, log=sys.stderr) -> tuple[torch.dtype, dict[str, float]]:
    """The dtype to run a draft head in on its device: float32 unless another supported
    dtype runs a step's draft calls (``_head_step``: the root call and one call of ``rows``
    nodes, a draft call's width) at least ``margin`` times faster. Timed round-robin on
    cast copies, their weights packed where that pays as the loader runs them; with
    ``target`` (the model the head drafts for), its output projection runs untimed before
    each timed step (``output_projection_gap``), so the head's weights are read from memory
    as in a decode, where each step's verify forward streams the target's weights through
    the caches. Cached per machine + ``head_id``. Returns ``(dtype, {dtype name: median ms})``.

    Why whole calls and cold caches: the head's ``Linear`` layers alone, timed back to back
    (the weights, 20-39 MB, staying in the caches), read 2.8 ms in both dtypes on the
    AVX2-only AMD EPYC, while whole calls after a target forward, as in a decode, ran 10-19%
    faster in bfloat16, half the bytes to read (docs/results.md, "The draft head's dtype
    timed as a decode runs it").
    """
    if not (isinstance(margin, (int, float)) and margin >= 1.0):
        raise ValueError(f"margin={margin!r} is out of range: allowed a number >= 1")
    if not (isinstance(rows, int) and rows >= 1):
        raise ValueError(f"rows={rows!r} is out of range: allowed an int >= 1")
    if not isinstance(head, Eagle3Head):
        raise TypeError(f"head is a {type(head).__name__}: allowed an Eagle3Head")
    dev = next(head.parameters()).device
    before = None if target is None else output_projection_gap(target)
    key = cache_key("head_dtype", f"{head_id} ({PACKING_RULE})", dev, rows=rows, timed="root and nodes",
                    gap="none" if before is None else "projection")
    hit = _cached_dtype(HEAD_DTYPE_CACHE, key, use_cache,
                        "draft dtype auto: %s (cached; measured ms per step's draft calls: %s)", log)
    if hit is not None:
        return hit
    cands = {str(dt).removeprefix("torch."): _head_step(packed_copy(head, dt), rows)
             for dt in supported_dtypes(dev)}
    _, ms = fastest(cands, reps=reps, timer=timer, before=before)
    best = "float32"
    for name, t in ms.items():
        if name != "float32" and ms["float32"] >= margin * t and t < ms[best]:
            best = name
    del cands
    where = f"; cached in {cache_write(HEAD_DTYPE_CACHE, key, {'dtype': best, 'ms': ms})}" if use_cache else ""
    after = "" if before is None else ", after the target's output projection"
    print(f"draft dtype auto: {best} (measured ms per step's draft calls{after}: {_fmt(ms)}; another dtype "
          f"than float32 needs {margin:g}x{where})", file=log)
    return getattr(torch, best), ms


def _cached_dtype(cache: str, key: str, use_cache: bool, message: str,
                  log) -> tuple[torch.dtype, dict[str, float]] | None:
    """A dtype choice stored under ``key`` in ``cache`` (``(dtype, ms)``, reported with
    ``message % (dtype, ms)``), or None when there is none or measuring is asked for."""
    if not (use_cache and _read_cache()):
        return None
    rec = cache_read(cache, key)
    if rec is None or not hasattr(torch, str(rec.get("dtype"))):
        return None
    print(message % (rec["dtype"], _fmt(rec.get("ms", {}))), file=log)
    return getattr(torch, rec["dtype"]), dict(rec.get("ms", {}))


def _fmt(ms: Mapping[str, float]) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in ms.items())


class _TimedDraft(DraftModel):
    """A draft adapter that records (frontier width, seconds) of every ``node_logits`` call
    and passes everything else to the adapter it wraps."""

    def __init__(self, inner, timer: Timer) -> None:
        self._inner, self._timer = inner, timer
        self.calls: list[tuple[int, float]] = []
        self.vocab_size = inner.vocab_size
        self.device = getattr(inner, "device", None)
        self.vocab_ids = getattr(inner, "vocab_ids", None)

    def start(self, prompt_ids):
        self._inner.start(prompt_ids)

    def commit(self, tree, path_nodes, emitted, features):
        self._inner.commit(tree, path_nodes, emitted, features)

    def check_vocab_map(self, target_vocab_size):
        self._inner.check_vocab_map(target_vocab_size)

    def take_prompt_features(self, target):
        self._inner.take_prompt_features(target)

    def close(self):
        self._inner.close()

    def node_logits(self, tree, nodes):
        return self._timed(self._inner.node_logits, tree, nodes)

    def vocab_logits(self, tree, nodes):
        return self._timed(self._inner.vocab_logits, tree, nodes)

    def _timed(self, call, tree, nodes):
        t0 = self._timer()
        out = call(tree, nodes)
        self.calls.append((len(nodes), self._timer() - t0))
        return out


def measure_batch_verify(model, *, batch_sizes: Sequence[int] = BATCH_SIZES,
                         row_sizes: Sequence[int] = BATCH_ROW_SIZES, ctx: int = 64,
                         reps: int = 3, timer: Timer = time.perf_counter,
                         log=None) -> tuple[tuple[float, ...], ...]:
    """``c_v(B, n)`` on a grid: the median latency (ms) of one batched verify forward of ``B``
    rows x ``n`` new tokens each over ``ctx`` cached tokens per row, for every ``B`` in
    ``batch_sizes`` and ``n`` in ``row_sizes`` (each row monotone in ``n``).

    Each forward is what a batched decode's verify forward does (``forward_trees``, the
    span ``StepStats.t_verify_forward`` times), through the same call
    (``_hf_common.run_base_rows``, the lean decoder forward and its folded attention): the
    decoder stack over a rectangular ``[B, n]`` block (rows padded to the widest tree) with
    a bool mask (every row sees its cached prefix and the block's causal part; all True for
    one-token rows), each after an output projection as in a decode (``batch_verify_ms``).
    Why the decode's call: the grid once called the transformers model itself, whose
    per-layer dispatch and mask handling a decode skips; on a 2-core Zen 4 EPYC its 4-row
    forwards of 2-3 tokens read 1.08-1.23x what the decode's took (one scale,
    ``batch_tree_scale``, measured at 7 tokens, read 0.93: not enough at 2-3), so 4-row trees
    looked 4 ms dearer than they were and the cost model kept plain steps that ran 10%
    slower than one level of two children (docs/results.md, "Thirty-first round"). The
    output projections are left out: the walk makes them, so they are in the bookkeeping
    ``c_o`` measured from real decodes (counting them here too priced every step's
    projections twice). The cache is filled with random keys and
    values (the latency does not depend on them, and it saves a prefill of ``B * ctx``
    tokens) and cropped back to ``ctx`` after every forward. With the default grid, 15
    short forwards (x ``reps + 1``), timed round-robin per batch size (``round_robin_ms``).
    ``log``: where a warning goes if a row still drops with more tokens (``dips``: the
    machine was busy); None: no warning.
    """
    for name, xs in (("batch_sizes", batch_sizes), ("row_sizes", row_sizes)):
        if not xs or list(xs) != sorted(set(xs)) or any(isinstance(x, bool) or not isinstance(x, int) or x < 1
                                                       for x in xs):
            raise ValueError(f"{name}={list(xs)}: allowed increasing ints >= 1")
    if ctx < 1:
        raise ValueError(f"ctx={ctx} is out of range: allowed >= 1")
    gen = torch.Generator().manual_seed(0)
    grid = []
    for B in batch_sizes:
        grid.append(_curve(row_sizes, batch_verify_ms(model, B, row_sizes, ctx, reps=reps, timer=timer, gen=gen),
                           f"the batched verify latency of {B} rows", log))
    return tuple(grid)


def batch_verify_ms(model, B: int, row_sizes: Sequence[int], ctx: int, *, reps: int,
                    timer: Timer = time.perf_counter, gen: torch.Generator | None = None) -> list[float]:
    """Median ms (``round_robin_ms``) of ``batch_forwards(model, B, row_sizes, ctx)``, each
    timed after an output projection (``output_projection_gap``), as a decode runs its
    forwards after the walk's projections and as ``chain_verify_ms`` times one row's."""
    return round_robin_ms(batch_forwards(model, B, row_sizes, ctx, gen), reps=reps, timer=timer,
                          before=output_projection_gap(model))


def batch_forwards(model, B: int, row_sizes: Sequence[int], ctx: int,
                   gen: torch.Generator | None = None, run=None) -> list[Callable[[], None]]:
    """One call per ``n`` in ``row_sizes``: the rectangular batched verify forward of ``B``
    rows x ``n`` new tokens over ``ctx`` cached tokens per row that ``measure_batch_verify``
    times (random keys and values, cropped back to ``ctx`` after each call; the calls share
    one cache, freed with them). ``run(base, cache, tokens, positions, allowed)`` makes the
    forward (default: ``run_base_rows``, the decode's own call; ``examples/measure_batch_grid.py``
    passes the transformers model's call to compare)."""
    base = base_model(model)
    p = next(model.parameters())
    cfg = model.config
    n_kv = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    vocab = int(cfg.vocab_size)
    gen = torch.Generator().manual_seed(0) if gen is None else gen
    with torch.no_grad():
        cache = new_cache(model)
        for layer in range(len(base.layers)):
            kv = torch.randn(2, B, n_kv, ctx, head_dim, generator=gen).to(p.device, p.dtype)
            cache.update(kv[0], kv[1], layer)
    forwards = []
    for n in row_sizes:
        tok = torch.randint(0, vocab, (B, n), generator=gen).to(p.device)
        pos = (ctx + torch.arange(n, device=p.device)).expand(B, n)
        # every row sees its ``ctx`` cached entries and the block's causal part: the bool
        # mask a batched decode's ``RowCache.forward`` hands ``run_base_rows`` (all True
        # for one-token rows, which then pass an all-zero mask, as a plain step does)
        allowed = torch.ones(B, n, ctx + n, dtype=torch.bool, device=p.device)
        allowed[:, :, ctx:] = torch.ones(n, n, dtype=torch.bool, device=p.device).tril()

        def fwd(tok=tok, pos=pos, allowed=allowed, cache=cache) -> None:
            with torch.no_grad():
                (run or run_base_rows)(base, cache, tok, pos, allowed)
            crop_cache(cache, ctx)
            if p.device.type == "cuda":
                torch.cuda.synchronize(p.device)

        forwards.append(fwd)
    return forwards


#: the forwards ``glue_timings`` times, (rows, new tokens per row) over ``GLUE_CONTEXT``
#: cached tokens: a one-token step, one row's tree verify, a batch's tree verify
GLUE_PROBES = ((1, 1), (1, 8), (4, 2))
GLUE_CONTEXT = 64


def glue_timings(model, reps: int = 7, timer: Timer = time.perf_counter) -> tuple[list[float], list[float], bool]:
    """``(unfused, fused, same)``: the median ms of each ``GLUE_PROBES`` forward (the
    decode's own call, ``batch_forwards``) with the decoder's glue as torch operators and
    fused (``lean_llama.fuse_glue``), alternating call by call, and whether the two gave the
    same hidden states bit for bit in every probe. Leaves the glue unfused."""
    base = base_model(model)
    pairs = []
    for rows, tokens in GLUE_PROBES:
        pair = []
        for on in (False, True):
            got: list[torch.Tensor] = []

            def run(b, cache, tok, pos, allowed, on=on, got=got) -> None:
                fuse_glue(b, on)
                got[:] = [run_base_rows(b, cache, tok, pos, allowed)]
            # the same seed on both sides: the same cache and tokens
            fwd, = batch_forwards(model, rows, [tokens], GLUE_CONTEXT, torch.Generator().manual_seed(tokens), run=run)
            pair.append((fwd, got))
        pairs.append(pair)
    try:
        ms = round_robin_ms([fwd for pair in pairs for fwd, _ in pair], reps=reps, timer=timer)
    finally:
        fuse_glue(base, False)
    same = all(torch.equal(a[0], b[0]) for (_, a), (_, b) in pairs)
    return ms[0::2], ms[1::2], same


def batched_decode_unavailable() -> str | None:
    """None when ``plan_and_decode`` decodes a list of prompts into one result per row
    (batched decoding), else why not (tried on a tiny functional model, no real work)."""
    lm = hashed_context_lm(vocab_size=4, seed=0)
    try:
        out = plan_and_decode(lm, lm, [[0, 1], [1, 2, 3]], max_new_tokens=2, seed=0,
                              tree=TreeConfig(depth=1, frontier=1, slots=2, budget=2, support=4))
    except (TypeError, ValueError) as exc:
        return f"it raised {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    if not isinstance(out, list) or len(out) != 2:
        return f"it returned {type(out).__name__}, not one result per row"
    return None


def _per_call_draft_ms(steps, depth: int) -> float:
    """Median draft time per call (ms) of drafted steps: one call per depth."""
    return statistics.median([1e3 * s.t_draft / max(1, depth) for s in steps if s.drafted] or [0.0])


def one_depth_tree(tree):
    """``tree`` cut to one drafted depth (the root's children): the shallowest tree step,
    whose bookkeeping against ``tree``'s gives the cost of each further depth."""
    return tree.with_(depth=1, budget=min(tree.budget, tree.slots))


def narrow_tree(tree):
    """``tree`` cut to one drafted depth of one node (the root's best child, of ``slots``
    drafted): the narrowest tree step, whose bookkeeping against ``one_depth_tree``'s gives
    how it grows with the nodes per row (``Timings.batch_overhead_narrow_ms``)."""
    return tree.with_(depth=1, frontier=1, budget=1)


def overhead_by_depth(full_ms: float, one_ms: float, depth: int) -> tuple[float, float]:
    """``(c_o at one depth, c_o per further depth)`` from the bookkeeping of a ``depth``-deep
    fixed tree and of a one-depth tree (ms); the per-depth cost is never below 0 (a noisy
    pair gives a flat c_o).

    Example: 8.6 ms at depth 6, 4.5 ms at depth 1 -> (4.5, 0.82).
    """
    if depth <= 1:
        return full_ms, 0.0
    return one_ms, max(0.0, (full_ms - one_ms) / (depth - 1))


def measure_batch_steps(model, draft, prompt_ids: Sequence[int], *, tree, sampling, batch_sizes: Sequence[int],
                        steps: int = 8) -> tuple[tuple[float, ...], ...]:
    """Per batch size ``B`` in ``batch_sizes`` (each > 1): short batched decodes of ``B``
    copies of ``prompt_ids`` with the fixed tree ``tree``, with it cut to one depth
    (``one_depth_tree``), to one node a row (``narrow_tree``) and without a draft, giving
    ``(draft ms per batched call, bookkeeping ms per tree step of one drafted depth, per
    further depth, per autoregressive step, forward ms per autoregressive step, per tree
    step of one node a row)`` of the whole batch (medians over the steps while every row
    was live, the first step left out: it runs the prompts through the draft;
    ``overhead_by_depth`` splits the two trees' bookkeeping). Needs batched decoding
    (``batched_decode_unavailable() is None``)."""
    draft_ms, tree_oh, depth_oh, ar_oh, ar_fw, narrow_oh = [], [], [], [], [], []

    def live_steps(res):
        live = min(len(r.steps) for r in res)  # steps while every row was in the batch
        return res[0].steps[1:live] or res[0].steps[:1]

    for B in batch_sizes:
        rows = [list(prompt_ids) for _ in range(B)]
        st = live_steps(plan_and_decode(model, draft, rows, max_new_tokens=steps, sampling=sampling, tree=tree,
                                        seed=0))
        draft_ms.append(_per_call_draft_ms(st, tree.depth))
        st1 = st if tree.depth <= 1 else live_steps(plan_and_decode(
            model, draft, rows, max_new_tokens=steps, sampling=sampling, tree=one_depth_tree(tree), seed=0))
        one, per_depth = overhead_by_depth(_overhead_ms_of(st), _overhead_ms_of(st1), tree.depth)
        tree_oh.append(one)
        depth_oh.append(per_depth)
        ar_steps = live_steps(plan_and_decode(model, None, rows, max_new_tokens=steps, sampling=sampling, seed=0))
        ar_oh.append(_overhead_ms_of(ar_steps))
        ar_fw.append(statistics.median([1e3 * s.t_verify_forward for s in ar_steps]))
        narrow_oh.append(_overhead_ms_of(live_steps(plan_and_decode(
            model, draft, rows, max_new_tokens=steps, sampling=sampling, tree=narrow_tree(tree), seed=0))))
    return tuple(draft_ms), tuple(tree_oh), tuple(depth_oh), tuple(ar_oh), tuple(ar_fw), tuple(narrow_oh)


#: the small fixed tree ``measure_batch_tree_verify`` decodes with (depth, budget): about
#: the size of the trees the cost model keeps at a few rows
SMALL_TREE = (3, 6)


def measure_batch_tree_verify(model, draft, prompt_ids: Sequence[int], *, tree, sampling, batch_sizes: Sequence[int],
                              steps: int = 8) -> tuple[tuple[float, float], ...]:
    """Per batch size ``B`` in ``batch_sizes`` (each > 1): ``(verify ms, row tokens)``, the
    median ``t_verify_forward`` of a short batched decode of ``B`` copies of ``prompt_ids``
    with a small fixed tree (``tree`` cut to ``SMALL_TREE``) and the median widest row
    (root included) those forwards carried; the steps while every row was live, the first
    left out. What a real tree forward costs at ``B`` rows, against which
    ``measure_timings`` scales the grid of rectangular forwards (``Timings.batch_tree_scale``).

    The decode runs twice and the faster median is kept (load only slows a forward): on the
    2-core Zen 4 AMD EPYC one such median once read 1.49x its grid point and 1.05x when
    measured again, and the cost model then priced every 4-row tree out (plain steps only;
    docs/results.md, "Thirty-second round")."""
    depth, budget = SMALL_TREE
    small = tree.with_(depth=min(tree.depth, depth), budget=min(tree.budget, budget))
    out = []
    for B in batch_sizes:
        rows = [list(prompt_ids) for _ in range(B)]
        runs = []
        for _ in range(2):
            res = plan_and_decode(model, draft, rows, max_new_tokens=steps, sampling=sampling, tree=small, seed=0)
            live = min(len(r.steps) for r in res)
            idx = list(range(1, live)) or [0]
            ms = statistics.median([1e3 * res[0].steps[i].t_verify_forward for i in idx])
            widest = statistics.median([1 + max(r.steps[i].tree_size for r in res) for i in idx])
            runs.append((ms, float(widest)))
        out.append(min(runs))
    return tuple(out)


def timings_key(model_id: str, device, dtype: str, draft_id: str, tree, batch_sizes: Sequence[int],
                batch_row_sizes: Sequence[int]) -> str:
    """The cache key of ``measure_timings``' record: the machine, the model, the draft, the
    tree's shape, the batch sizes measured, and a tag per change that made older records
    stale (they are measured again)."""
    batch_sizes, batch_row_sizes = tuple(batch_sizes), tuple(batch_row_sizes)
    return cache_key("timings", model_id, device, dtype=dtype, draft=draft_id,
                     tree=f"{tree.depth}x{tree.frontier}x{tree.slots}",
                     batch="x".join(map(str, batch_sizes)) + "/" + "x".join(map(str, batch_row_sizes)),
                     batched_loop=batch_sizes != () and batched_decode_unavailable() is None,
                     verify="forward",  # c_v without the output projections (older records had them)
                     tree_scale=True,  # batch_tree_scale measured (older records lack it)
                     ar_rows=3,  # the leaner batched plain step (f57ec9c) and batch_ar_scale
                     rounds="round-robin",  # c_v timed round-robin (older records could hold one hiccup)
                     overhead="by-depth",  # c_o at one depth + per further depth, every batch size (older: rows flat)
                     kv="in-place",  # KV appends without a copy of the cache (growing_cache.GrowingLayer)
                     gap="projection",  # c_v timed after an output projection (older records: back to back)
                     scales="anchored",  # batched scales against the grid timed right after (older: its own)
                     narrow="one-node",  # the batched one-depth price by nodes per row (older: one price)
                     grid="checked",  # a grid row off its anchors timed again (older records could keep a spike)
                     tree_anchor="min-of-2",  # the real tree forward the faster of two decodes (older: one)
                     grid_call="decode")  # the grid through the decode's run_base_rows (older: the model's forward)


def measure_timings(model, draft, prompt_ids: Sequence[int], *, tree, sampling=None,
                    ctx: tuple[int, int] = (64, 512), sizes: Sequence[int] = VERIFY_SIZES,
                    reps: int = 5, steps: int = 24, model_id: str | None = None,
                    draft_id: str = "", use_cache: bool = True, timer: Timer = time.perf_counter,
                    batch_sizes: Sequence[int] = BATCH_SIZES, batch_row_sizes: Sequence[int] = BATCH_ROW_SIZES,
                    log=sys.stderr, cached_only: bool = False) -> Timings | None:
    """The cost model's latencies for ``model`` (+ ``draft``) on this machine (cached).

    * ``c_v(n, ctx)``: a verify forward of ``n`` tokens (``sizes``) at two context lengths
      (the sizes timed round-robin, ``round_robin_ms``: the median of ``reps`` rounds);
    * ``c_v(B, n)``: a batched verify forward of ``B`` rows (``batch_sizes``) x ``n`` tokens
      each (``batch_row_sizes``) at the shorter context (``measure_batch_verify``; pass
      ``batch_sizes=()`` to skip it: batches are then priced as one row of ``B * n`` tokens);
    * ``c_d(w)``, ``c_o``: a short real decode of ``steps`` tokens with the fixed tree
      ``tree`` (median draft-call time per frontier width; median bookkeeping per step);
    * ``c_o'``: the same for a plain autoregressive decode;
    * where ``plan_and_decode`` takes a list of prompts: the batched draft call and the
      bookkeeping per step at each batch size > 1 (``measure_batch_steps``), and a real
      small-tree forward at each, which scales the grid (``measure_batch_tree_verify``,
      ``Timings.batch_tree_scale``); otherwise they are modelled from the batch-1 numbers
      (``Timings.draft_batch``).

    Takes a few seconds the first time on a CPU; the cache makes later loads instant.
    ``cached_only``: return the cached record, or None where there is none (or
    ``RHEOPLAN_REMEASURE`` asks for a new one), and measure nothing.
    """
    sampling = sampling or SamplingConfig()
    dev = next(model.parameters()).device
    dt = str(next(model.parameters()).dtype).removeprefix("torch.")
    mid = model_id or model_identity(model)
    batch_sizes, batch_row_sizes = tuple(batch_sizes), tuple(batch_row_sizes)
    key = timings_key(mid, dev, dt, draft_id, tree, batch_sizes, batch_row_sizes)
    if use_cache and _read_cache():
        rec = cache_read(TIMINGS_CACHE, key)
        if rec is not None:
            try:
                tm = Timings.from_dict(rec)
            except (ValueError, TypeError):
                tm = None  # a stale record: measure again
            if tm is not None and any(jumps(tm.sizes, curve) for curve in (tm.verify_lo, tm.verify_hi)):
                print("cost model: the cached verify latencies jump after one token (timed across two "
                      "speeds of the machine): measuring them again", file=log)
                tm = None
            if tm is not None:
                print(f"cost model: cached latencies ({_describe(tm)})", file=log)
                note = stale_speed_note(model, tm, timer=timer)
                if note is not None:
                    print(f"cost model: {note}", file=log)
                return tm
    if cached_only:
        return None
    more = [b for b in batch_sizes if b > 1]
    # 18 s in one run on the 2-core CPU, once per machine, model and head: say what the wait is
    bar = tqdm(total=len(ctx) + 4 + len(more), unit="part", file=log, leave=False,
               desc=f"cost model: measuring this machine's latencies (once: cached in {cache_dir() / TIMINGS_CACHE})")
    log = _AboveBar(bar, log)  # a warning meanwhile gets its own line above the bar
    # the forward alone, as StepStats.t_verify_forward times it: the walk's output
    # projections are bookkeeping (c_o), measured in the decodes below
    lo_hi = []
    for c in ctx:
        ms = chain_verify_ms(model, c, sizes, reps=reps, timer=timer)
        if dips(sizes, ms) or jumps(sizes, ms):  # a busy spell: once more
            again = chain_verify_ms(model, c, sizes, reps=reps, timer=timer)
            # each size keeps its faster median, unless that keeps a jump the retake lacks:
            # then the retake, timed in one spell, is the consistent curve
            faster = retimed(ms, again)
            ms = again if jumps(sizes, faster) and not jumps(sizes, again) else faster
        lo_hi.append(_curve(sizes, ms, f"the verify latency at {c} cached tokens", log))
        bar.update()
    grid = (measure_batch_verify(model, batch_sizes=batch_sizes, row_sizes=batch_row_sizes, ctx=ctx[0],
                                 reps=reps, timer=timer, log=log) if batch_sizes else ())
    bar.update()
    inner = as_draft(draft)
    timed = _TimedDraft(inner, timer)
    ids = list(prompt_ids)
    try:
        res = plan_and_decode(model, timed, ids, max_new_tokens=steps, sampling=sampling, tree=tree, seed=0)
    finally:
        if inner is not draft:
            inner.close()
    widths: dict[int, list[float]] = {}
    for w, s in timed.calls[1:]:  # the first call also runs the prompt through the head
        widths.setdefault(w, []).append(1e3 * s)
    if not widths:
        widths = {w: [1e3 * s] for w, s in timed.calls}
    bar.update()
    # the bookkeeping grows with the tree's depth (more passes, a longer walk): a decode
    # of the same tree cut to one depth gives c_o at one depth and per further depth
    res1 = res if tree.depth <= 1 else plan_and_decode(model, draft, ids, max_new_tokens=steps, sampling=sampling,
                                                       tree=one_depth_tree(tree), seed=0)
    full = _overhead_ms(res)
    overhead, per_depth = overhead_by_depth(full, _overhead_ms(res1), tree.depth)
    wide = one_depth_tree(tree).budget  # nodes per row of the one-depth price
    bar.update()
    ar = plan_and_decode(model, None, ids, max_new_tokens=max(4, steps // 2), sampling=sampling, seed=0)
    bar.update()
    stepped: dict = {}
    if grid and batched_decode_unavailable() is None:
        d, o, od, a, tree_scale, ar_scale, on = [], [], [], [], [], [], []
        # one row's one-node price (batch sizes between 1 and the next interpolate to it)
        narrow = _overhead_ms(plan_and_decode(model, draft, ids, max_new_tokens=steps, sampling=sampling,
                                              tree=narrow_tree(tree), seed=0)) if 1 in batch_sizes else 0.0
        for B in more:
            bd, bo, bod, ba, bfw, bon = measure_batch_steps(model, draft, ids, tree=tree, sampling=sampling,
                                                            batch_sizes=[B])
            # each real forward against the grid's forward of its shape timed right after it,
            # not against the grid of the minute before: on the noisy 2-core CPU a real 4-row
            # plain step once read 1.36x its grid point so (and 16 rows 0.91x), the cost model
            # then priced plain 4-row steps 15% above what they took and drafted trees that lost
            # 7% at T = 0 (docs/results.md, "Sixteenth measurement")
            ar_now = batch_verify_ms(model, B, (1,), ctx[0], reps=reps, timer=timer)[0]
            (ms, n), = measure_batch_tree_verify(model, draft, ids, tree=tree, sampling=sampling, batch_sizes=[B])
            k = max(2, int(round(n)))
            tree_now = batch_verify_ms(model, B, (k,), ctx[0], reps=reps, timer=timer)[0]
            i = list(batch_sizes).index(B)
            fresh = {1: ar_now, k: tree_now}
            if grid_disagrees(batch_row_sizes, grid[i], fresh):
                # one point of the row came from another spell of the machine (a 4-row
                # one-token forward once read 65.6 ms in the grid and 37.5 when timed again):
                # the row once more, each point keeping the lower of its two timings
                again = measure_batch_verify(model, batch_sizes=(B,), row_sizes=batch_row_sizes, ctx=ctx[0],
                                             reps=reps, timer=timer)[0]
                print(f"cost model: the batched verify latency of {B} rows ({_fmt_row(batch_row_sizes, grid[i])}) "
                      f"was off the same forwards timed again ({_fmt_row(list(fresh), list(fresh.values()))}): "
                      f"timed its row again ({_fmt_row(batch_row_sizes, again)})", file=log)
                grid = grid[:i] + (_curve(batch_row_sizes, retimed(grid[i], again),
                                          f"the batched verify latency of {B} rows", log),) + grid[i + 1:]
            # each anchor: the lower of the grid's point and its timing right after the real
            # forward (load only slows a forward)
            a1 = min(interp(batch_row_sizes, grid[i], 1), ar_now)
            ak = min(interp(batch_row_sizes, grid[i], k), tree_now)
            d += bd
            o += bo
            od += bod
            a += ba
            on += bon
            tree_scale.append(max(ms, 1e-3) / max(ak, 1e-3))
            ar_scale.append(max(bfw[0], 1e-3) / max(a1, 1e-3))
            bar.update()
        one = [b for b in batch_sizes if b == 1]  # batch 1: the batch-1 decodes above
        pick = lambda first, rest: tuple([first] * len(one) + list(rest))  # noqa: E731
        # the bookkeeping by depth at every batch size, as at one row (Timings.tree_overhead)
        stepped = dict(batch_draft_ms=pick(_per_call_draft_ms(res.steps[1:] or res.steps, tree.depth), d),
                       batch_draft_width=(1 + (tree.depth - 1) * tree.frontier) / max(1, tree.depth),
                       batch_overhead_ms=pick(overhead, o), batch_overhead_depth_ms=pick(per_depth, od),
                       batch_ar_overhead_ms=pick(_overhead_ms(ar), a),
                       # the one-depth price by nodes per row: one node, and the one-depth tree's
                       **(dict(batch_overhead_narrow_ms=pick(narrow, on), batch_overhead_width=wide)
                          if wide >= 2 else {}),
                       # a real small-tree forward and a real plain step's forward over the grid's
                       batch_tree_scale=pick(1.0, tree_scale), batch_ar_scale=pick(1.0, ar_scale))
    tm = Timings(tuple(sizes), lo_hi[0], lo_hi[1], ctx[0], ctx[1],
                 tuple(sorted(widths)), tuple(statistics.median(widths[w]) for w in sorted(widths)),
                 overhead, _overhead_ms(ar),
                 batch_sizes if grid else (), batch_row_sizes if grid else (), grid, overhead_depth_ms=per_depth,
                 **stepped)
    bar.close()
    if use_cache:
        cache_write(TIMINGS_CACHE, key, tm.to_dict())
        if tm.batch_sizes:  # its one-row part is the newest record of one row's prices too
            cache_write(TIMINGS_CACHE, timings_key(mid, dev, dt, draft_id, tree, (), batch_row_sizes),
                        tm.one_row().to_dict())
    print(f"cost model: measured latencies ({_describe(tm)})", file=log)
    return tm


def chain_verify_ms(model, ctx: int, sizes: Sequence[int], *, reps: int, warmup: int = 1,
                    timer: Timer = time.perf_counter) -> list[float]:
    """Median ms (``round_robin_ms``) of ``model``'s verify forward (``forward_tree``, no
    output projection) of a chain of ``n`` tokens for each ``n`` in ``sizes``, over a cache
    of ``ctx`` tokens of a fixed synthetic prompt: what ``c_v(n, ctx)`` records.

    Each forward is timed right after an output projection of one row (untimed,
    ``output_projection_gap``), as a decode runs it: after the previous step's walk.
    Why: timed back to back, a 17-token forward of bfloat16 SmolLM2 on the 2-core CPU cost
    1.24-1.33x a one-token forward, against 1.44-1.77x inside real decodes and, in two
    measurements of three, 1.34-1.59x after a projection; priced back to back, the cost
    model planned trees too large to pay (docs/results.md, "Forwards timed as a decode
    runs them")."""
    vocab = int(model.config.vocab_size)
    prompt = [(7 * i + 3) % vocab for i in range(ctx + 1)]
    tgt = as_target(model)
    try:
        with torch.no_grad():
            tgt.start(prompt)
            forwards = [partial(tgt.forward_tree, chain_linear(prompt[-1], ctx, n)) for n in sizes]
            return round_robin_ms(forwards, reps=reps, warmup=warmup, timer=timer,
                                  before=output_projection_gap(model))
    finally:
        if hasattr(tgt, "close"):
            tgt.close()


def output_projection_gap(model) -> Callable[[], object] | None:
    """A call that projects one zero hidden state through ``model``'s output embeddings
    (its lm_head: the largest matrix a CPU walk streams between two verify forwards), and
    waits for it on a GPU; None for a model without output embeddings."""
    try:
        head = output_head(model)
    except TypeError:
        return None
    p = next(model.parameters())
    hidden = torch.zeros(1, int(model.config.hidden_size), dtype=p.dtype, device=p.device)
    sync = torch.cuda.synchronize if p.device.type == "cuda" else None

    def gap():
        with torch.no_grad():
            head(hidden)
        if sync is not None:
            sync()

    return gap


#: a cached one-token forward this far off the one timed at load (either way) is reported
STALE_SPEED_RATIO = 1.3


def stale_speed_note(model, tm: Timings, *, reps: int = 5, timer: Timer = time.perf_counter) -> str | None:
    """A note when a one-token verify forward timed now is ``STALE_SPEED_RATIO`` or more
    times slower or faster than the cached latency, else None. Timed as the record was
    measured (at ``tm.ctx_lo`` cached tokens): the median of ``reps`` forwards after two
    untimed ones, about 0.2 s on the 2-core CPU.

    Why: the cache is keyed per machine and model, but a machine's speed moves (another
    tenant, another host of the same kind: 15.6 ms cached against 24.6 ms measured in one
    session, docs/results.md). Decisions stay exact whatever the latencies (they are frozen
    numbers, not the target's output), but the trees are sized for the cached speed; the
    user should know, and may measure again. Only a note: acting on a live timing would make
    the tokens depend on the machine's mood (the same seed must give the same tokens)."""
    c = int(tm.ctx_lo)
    now = chain_verify_ms(model, c, (1,), reps=reps, warmup=2, timer=timer)[0]
    cached = tm.verify(1, c)
    ratio = now / max(cached, 1e-9)
    if 1 / STALE_SPEED_RATIO < ratio < STALE_SPEED_RATIO:
        return None
    return (f"a one-token forward took {now:.1f} ms now against the cached {cached:.1f} ms ({ratio:.2f}x): "
            "this machine is busier, quieter or another host than when the latencies were measured. "
            "Every token is still exact, but the trees are sized for the cached speed; "
            "RHEOPLAN_REMEASURE=1 measures again")


def monotone(ms: Sequence[float]) -> tuple[float, ...]:
    """Running maximum of latencies measured at increasing token counts: a forward over
    more tokens never costs less, so a dip is measurement noise (another process, a cache
    effect) and must not make the cost model prefer bigger trees.

    Example: [40, 38, 55, 50] -> (40, 40, 55, 55).
    """
    out, top = [], float("-inf")
    for v in ms:
        top = max(top, float(v))
        out.append(top)
    return tuple(out)


#: a larger forward measured this much below a smaller one is taken for a busy machine
DIP_TOLERANCE = 0.10


def dips(sizes: Sequence[int], ms: Sequence[float], tolerance: float = DIP_TOLERANCE) -> list[tuple[int, int]]:
    """``(smaller, larger)`` size pairs where the forward over ``larger`` tokens measured more
    than ``tolerance`` below the slowest smaller one: impossible on a quiet machine (more
    tokens never cost less), so a sign that the machine was busy while ``smaller`` was
    timed. ``monotone`` hides such a spike by carrying it upwards.

    Example: 2 tokens read 19.8 ms, 4 tokens 15.3 ms:
        >>> dips((1, 2, 4, 8), (14.9, 19.8, 15.3, 17.0))
        [(2, 4), (2, 8)]
    """
    out, top, at = [], float("-inf"), None
    for n, v in zip(sizes, ms):
        if at is not None and float(v) < (1.0 - tolerance) * top:
            out.append((at, n))
        if float(v) > top:
            top, at = float(v), n
    return out


#: the first size step of a verify curve costing more than this share of all the later
#: steps together is taken for a curve timed across two speeds of the machine (``jumps``)
JUMP_SHARE = 0.5
#: ... where the later steps add at least this many tokens
JUMP_SPAN = 16


def jumps(sizes: Sequence[int], ms: Sequence[float], tolerance: float = DIP_TOLERANCE,
          share: float = JUMP_SHARE) -> bool:
    """True where the first size step of a verify curve (``sizes[0]`` -> ``sizes[1]`` tokens)
    costs more than ``tolerance`` of the smallest forward and more than ``share`` of every
    later step together (``sizes[1]`` -> ``sizes[-1]``, at least ``JUMP_SPAN`` tokens more).
    A forward streams the same weights whatever its size and adds a little compute per
    token, so one token more cannot cost half of what the next sixty-two cost: such a
    curve had its smallest size timed in a faster spell than the rest, which ``dips`` (a
    larger size measured faster) does not see. Priced from it, plain one-token steps look
    far cheaper than any tree. On the 2-core Intel Xeon the cache once kept [1: 52.4, 2:
    80.1, 4-16: 80.1, 32: 80.9, 64: 105.1] ms at 64 cached tokens (a retake read [1:
    72.7, 2: 75.7, ... 64: 118.0]).

    Example:
        >>> jumps((1, 2, 4, 64), (52.4, 80.1, 80.1, 105.1)), jumps((1, 2, 4, 64), (72.7, 75.7, 77.2, 118.0))
        (True, False)
    """
    if len(sizes) != len(ms):
        raise ValueError(f"jumps: {len(sizes)} sizes and {len(ms)} latencies: allowed one latency per size")
    if len(ms) < 3 or sizes[-1] - sizes[1] < JUMP_SPAN:  # too short a span to show the compute per token
        return False
    first, rest = float(ms[1]) - float(ms[0]), float(ms[-1]) - float(ms[1])
    return first > tolerance * float(ms[0]) and first > share * rest


#: a batched grid point this far (either way) from the same forward timed again beside the
#: real batched steps came from another spell of the machine (``grid_disagrees``)
GRID_ANCHOR_TOLERANCE = 1.2


def grid_disagrees(row_sizes: Sequence[int], row: Sequence[float], fresh: Mapping[int, float],
                   tolerance: float = GRID_ANCHOR_TOLERANCE) -> bool:
    """Whether any forward of ``fresh`` ({tokens per row: ms}, timed again beside the real
    batched steps) is more than ``tolerance`` times off the grid row's value at its size
    (interpolated), either way. The grid's prices are its row times a real forward over its
    fresh timing, so a grid point from a busy spell priced plain 4-row steps at 69 ms where
    they took 38, and the cost model drafted trees that lost (docs/results.md, "Twenty-fifth
    measurement").

    Example:
        >>> grid_disagrees((1, 2, 4), (65.6, 47.4, 61.1), {1: 37.5, 3: 55.0})
        True
        >>> grid_disagrees((1, 2, 4), (37.5, 47.4, 61.1), {1: 40.0, 3: 55.0})
        False
    """
    if len(row_sizes) != len(row):
        raise ValueError(f"grid_disagrees: {len(row_sizes)} sizes and {len(row)} latencies: allowed one per size")
    for n, ms in fresh.items():
        at = interp(row_sizes, row, n)
        if max(at, ms) > tolerance * max(min(at, ms), 1e-9):
            return True
    return False


def _fmt_row(sizes: Sequence[int], ms: Sequence[float]) -> str:
    return ", ".join(f"{n}: {v:.1f}" for n, v in zip(sizes, ms)) + " ms"


def retimed(first: Sequence[float], again: Sequence[float]) -> list[float]:
    """Each size's faster median of two measurements of one curve: load on the machine only
    ever slows a forward, so where the first measurement dips (``dips``: a busy spell timed
    some sizes slow) the lower of the two is the closer to the quiet cost. On the 2-core
    Intel Xeon the first measurement after the machine started read 53.9 ms for one token
    and 47.7 ms for two, which ``monotone`` carried as 53.9 ms up to four tokens.

    Example:
        >>> retimed([19.8, 15.3], [15.1, 15.9])
        [15.1, 15.3]
    """
    if len(first) != len(again):
        raise ValueError(f"retimed: {len(first)} and {len(again)} latencies: allowed one per size in both")
    return [min(float(a), float(b)) for a, b in zip(first, again)]


class _AboveBar:
    """A text stream for ``print`` that writes each line above ``bar`` (``tqdm.write``), so
    a message printed while the bar runs does not land on the bar's line."""

    def __init__(self, bar, stream) -> None:
        self.bar, self.stream = bar, stream

    def write(self, text: str) -> None:
        if text.strip():  # print writes its end ("\n") apart: tqdm.write adds one
            self.bar.write(text.rstrip("\n"), file=self.stream)

    def flush(self) -> None:
        self.stream.flush()


def _curve(sizes: Sequence[int], ms: Sequence[float], what: str, log) -> tuple[float, ...]:
    """``monotone(ms)``, with a warning on ``log`` (if given) where ``dips`` finds any."""
    bad = dips(sizes, ms)
    if bad and log is not None:
        pairs = ", ".join(f"{a} tokens {ms[list(sizes).index(a)]:.1f} ms > {b} tokens "
                          f"{ms[list(sizes).index(b)]:.1f} ms" for a, b in bad[:3])
        print(f"cost model: warning: {what} dropped with more tokens ({pairs}): the machine was "
              "probably busy while it was measured, and the cost model may plan trees too "
              "large; measure again on a quiet machine with RHEOPLAN_REMEASURE=1", file=log)
    if jumps(sizes, ms) and log is not None:
        print(f"cost model: warning: {what} jumped from {ms[0]:.1f} ms at {sizes[0]} token"
              f"{'' if sizes[0] == 1 else 's'} to "
              f"{ms[1]:.1f} ms at {sizes[1]}, more than from there to {sizes[-1]} tokens "
              f"({ms[-1]:.1f} ms): the machine's speed probably changed while it was measured, "
              "and the cost model may plan trees too small; measure again on a quiet machine with "
              "RHEOPLAN_REMEASURE=1", file=log)
    return monotone(ms)


def _overhead_ms(res) -> float:
    """Median per-step bookkeeping of a decode: the step's wall time less its draft calls
    and verify forward (plan, walk, commit, the loop itself); the first step is left out
    (it runs the prompt through the draft)."""
    return _overhead_ms_of(res.steps[1:] or res.steps)


def _overhead_ms_of(steps) -> float:
    """``_overhead_ms`` over the given steps."""
    return 1e3 * statistics.median([max(0.0, s.t_step - s.t_draft - s.t_verify_forward) for s in steps])


def _describe(tm: Timings) -> str:
    v = ", ".join(f"{n}:{ms:.1f}" for n, ms in zip(tm.sizes, tm.verify_lo))
    d = ", ".join(f"{w}:{ms:.1f}" for w, ms in zip(tm.draft_widths, tm.draft_ms))
    out = (f"verify ms by tokens at ctx {tm.ctx_lo} [{v}], draft ms by width [{d}], "
           f"overhead {tm.overhead_ms:.1f} ms/step + {tm.overhead_depth_ms:.1f} per further depth "
           f"(AR {tm.ar_overhead_ms:.1f})")
    if tm.batch_sizes:
        n = tm.batch_row_sizes[-1]
        b = ", ".join(f"{B}:{row[0]:.1f}/{row[-1]:.1f}" for B, row in zip(tm.batch_sizes, tm.batch_verify))
        out += f"; batched verify ms by rows at 1/{n} tokens per row [{b}]"
    if tm.batch_draft_ms and tm.batch_overhead_depth_ms:
        d = ", ".join(f"{B}:{x:.1f}/{o:.1f}+{od:.1f}" for B, x, o, od in
                      zip(tm.batch_sizes, tm.batch_draft_ms, tm.batch_overhead_ms, tm.batch_overhead_depth_ms))
        out += f"; batched draft call / overhead ms + per further depth by rows [{d}]"
    elif tm.batch_draft_ms:
        d = ", ".join(f"{B}:{x:.1f}/{o:.1f}" for B, x, o in zip(tm.batch_sizes, tm.batch_draft_ms, tm.batch_overhead_ms))
        out += f"; batched draft call / overhead ms by rows [{d}]"
    if tm.batch_overhead_narrow_ms:
        d = ", ".join(f"{B}:{x:.1f}" for B, x in zip(tm.batch_sizes, tm.batch_overhead_narrow_ms))
        out += f"; batched overhead ms at one depth of one node a row (of {tm.batch_overhead_width}) by rows [{d}]"
    if tm.batch_tree_scale:
        d = ", ".join(f"{B}:{x:.2f}" for B, x in zip(tm.batch_sizes, tm.batch_tree_scale))
        out += f"; real tree forward / grid by rows [{d}]"
    if tm.batch_ar_scale:
        d = ", ".join(f"{B}:{x:.2f}" for B, x in zip(tm.batch_sizes, tm.batch_ar_scale))
        out += f"; real one-token forward / grid by rows [{d}]"
    return out
