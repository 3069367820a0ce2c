"""What the command line and the benchmarks share: the default model and its draft, the
prompt encoding, the default run options and the ``--dtype`` flag.

It sits below both (``rheoplan.cli`` and ``rheoplan.bench`` import it, it imports
neither), so the benchmarks never import the CLI. Loading happens only when
``load_default`` is called; everything else is cheap.

Example (the spec parser needs no model):
    >>> parse_draft_spec("early-exit:6")
    ('early-exit', '6')
    >>> parse_draft_spec("early-exit:six")
    Traceback (most recent call last):
    ...
    ValueError: --draft='early-exit:six': L must be a layer count, e.g. early-exit:6
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from rheoplan.config import SamplingConfig, TreeConfig
from rheoplan.costmodel import (PRIORS_FILE, Calibration, CostModel, Timings, cache_key, cache_read, cache_write,
                                load_priors, remeasure_requested)
from rheoplan.decode import plan_and_decode
from rheoplan.kernels import source_digest
from rheoplan.kernels.decoder_glue import cpu as glue_kernels
from rheoplan.models._hf_common import base_model
from rheoplan.models.eagle3 import Eagle3Head, load_eagle3_checkpoint
from rheoplan.models.early_exit import early_exit_draft
from rheoplan.models.gqa_attention import fold_note, fold_pays, gqa_pays, one_query_note
from rheoplan.models.lean_llama import fuse_glue, glue_fused, lean_capable, lean_note
from rheoplan.models.packed_linear import PackedLinear, few_row_kernel, pack_if_it_pays
from rheoplan.models.smollm import GGUF_FILE, load_smollm2, resolve_dtype
from rheoplan.probe import GLUE_PROBES, choose_dtype, choose_head_dtype, glue_timings, measure_timings, model_identity
from rheoplan.stream import decode_requests

#: the default target's identity in the measurement caches
SMOLLM2_ID = f"SmolLM2-135M-Instruct ({GGUF_FILE})"
#: the prompt the latency probe decodes (any ordinary chat turn)
PROBE_PROMPT = "Write a short story about a lighthouse keeper and a storm."

#: Run defaults. ``depth`` and ``budget`` default to ``"auto"``: the cost model plans every
#: tree (``rheoplan.costmodel``; latencies measured at load and cached), up to AUTO_DEPTH
#: levels and AUTO_BUDGET kept nodes; an int fixes that dimension (the other one can stay
#: auto). Precedence in the CLI: these < a --config file < flags given on the command line.
DEFAULTS = {
    "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0,
    "repetition_penalty": 1.0, "seed": 0,
    "method": "rheo", "depth": "auto", "frontier": 3, "slots": 3, "budget": "auto", "rheostat": 1,
    "support": 128, "verifier": "rheo", "proxy": "default",
}
#: the fixed tree the benchmarks compare the fixed-shape methods at (depth 4, frontier 3,
#: slots 3, 8 kept nodes: the shape measured fastest before the cost model; docs/results.md)
FIXED_TREE = {"depth": 4, "frontier": 3, "slots": 3, "budget": 8}
#: options that take an int or "auto"
AUTO_OPTIONS = ("depth", "budget")
#: the largest tree the cost model may plan with ``--depth auto`` / ``--budget auto``
AUTO_DEPTH = 6
AUTO_BUDGET = 32
METHODS = ("rheo", "eagle", "chain", "autoregressive")

#: the EAGLE-3 head trained for SmolLM2-135M-Instruct that ships with rheoplan
SHIPPED_HEAD = Path(__file__).resolve().parent / "assets" / "smollm2-eagle3"


#: values of ``--draft-dtype``
DRAFT_DTYPES = ("auto", "float32", "bfloat16")


def add_dtype(p) -> None:
    """Add the ``--dtype`` (target weights and activations) and ``--draft-dtype`` (the EAGLE-3
    head's) flags to an argparse parser or group."""
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="target weights and activations: 'auto' = the dtype measured fastest on this "
                        "machine for the forward each step runs (1-token and 9-token verify-tree forwards "
                        "timed once at load, cached under ~/.cache/rheoplan/; the tree decides when a draft "
                        "is used, the 1-token forward for --method autoregressive) (default auto)")
    p.add_argument("--draft-dtype", choices=DRAFT_DTYPES, default="auto",
                   help="the EAGLE-3 draft head's dtype: 'auto' = float32 unless another dtype runs the "
                        "head's matmuls at least 1.2x faster on this machine (timed once at load, cached) "
                        "(default auto). Exactness does not depend on it")


def int_or_auto(text: str):
    """argparse type of ``--depth`` / ``--budget``: ``'auto'`` or an int."""
    if text == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{text!r} is not an int or 'auto'") from None


def parse_draft_spec(spec: str) -> tuple[str, str]:
    """``(kind, argument)`` of a ``--draft`` value: ``'auto'`` (the shipped EAGLE-3 head when
    present, else ``early-exit:6``), ``'early-exit:L'`` or ``'eagle3:DIR'``."""
    if spec == "auto":
        if (SHIPPED_HEAD / "config.json").is_file():
            return "eagle3", str(SHIPPED_HEAD)
        return "early-exit", "6"
    kind, _, arg = spec.partition(":")
    if kind not in ("early-exit", "eagle3") or not arg:
        raise ValueError(f"--draft={spec!r} is not understood: allowed 'auto', 'early-exit:L' or 'eagle3:DIR'")
    if kind == "early-exit" and not arg.isdigit():
        raise ValueError(f"--draft={spec!r}: L must be a layer count, e.g. early-exit:6")
    if kind == "eagle3" and not Path(arg).is_dir():
        raise ValueError(f"--draft={spec!r}: {arg} is not a directory")
    return kind, arg


def load_default(*, method: str = "rheo", draft: str = "auto", dtype: str = "auto", draft_dtype: str = "auto"):
    """``(target model, tokenizer, draft model or None)``: SmolLM2-135M-Instruct in ``dtype``
    (``'auto'``, ``'float32'``, ``'bfloat16'``) and the draft ``draft`` (a ``--draft`` spec;
    none for ``method='autoregressive'``); an EAGLE-3 head runs in ``draft_dtype``
    (``DRAFT_DTYPES``; ``'auto'``: ``rheoplan.probe.choose_head_dtype``). Progress goes to
    stderr."""
    if draft_dtype not in DRAFT_DTYPES:
        raise ValueError(f"draft_dtype={draft_dtype!r} is not one of {DRAFT_DTYPES}")
    t0 = time.perf_counter()
    torch_dtype = resolve_dtype(dtype)
    print(f"loading SmolLM2-135M-Instruct ({dtype}) ...", file=sys.stderr, flush=True)
    model, tok = load_smollm2(dtype=torch_dtype or torch.float32)
    if torch_dtype is None:  # 'auto': measure which dtype is fastest here (cached)
        # the forward that decides is the one each step of this method runs
        torch_dtype, _ = choose_dtype(model, model_id=SMOLLM2_ID,
                                      pick_by="one" if method == "autoregressive" else "tree")
        if torch_dtype != torch.float32:
            model = model.to(torch_dtype)
    pack_if_it_pays(model, "target")
    fuse_glue_if_it_pays(model, "target")
    for note in (one_query_note(model), fold_note(model), lean_note(model)):
        if note is not None:
            print(f"target: {note}", file=sys.stderr)
    drf = None
    if method != "autoregressive":
        kind, arg = parse_draft_spec(draft)
        drf = early_exit_draft(model, int(arg)) if kind == "early-exit" else load_head(arg, model, draft_dtype)
        print(f"draft: {kind} {arg}" + (f" ({model_dtype(drf.head)})" if kind == "eagle3" else ""),
              file=sys.stderr)
    print(f"loaded in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return model, tok, drf


def load_head(path, model, draft_dtype: str = "auto"):
    """The EAGLE-3 head in ``path`` drafting for ``model``, in ``draft_dtype``
    (``DRAFT_DTYPES``; ``'auto'``: ``rheoplan.probe.choose_head_dtype``, cached per machine
    and head directory)."""
    if draft_dtype not in DRAFT_DTYPES:
        raise ValueError(f"draft_dtype={draft_dtype!r} is not one of {DRAFT_DTYPES}")
    drf = load_eagle3_checkpoint(path, model)
    if draft_dtype == "auto":
        dt, _ = choose_head_dtype(drf.head, head_id=f"eagle3:{Path(path).resolve()}", target=model)
    else:
        dt = getattr(torch, draft_dtype)
    if dt != torch.float32:
        drf = load_eagle3_checkpoint(path, model, dtype=dt)
    pack_if_it_pays(drf.head, "draft head")
    fuse_head_glue(drf.head, model)
    return drf


def fuse_head_glue(head: Eagle3Head, target, log=None) -> bool:
    """Fuse ``head``'s glue (``Eagle3Head.fuse_glue``: its norms, residual sum and rotary
    embedding in one numba call each) where the target's glue runs fused
    (``fuse_glue_if_it_pays``: the same kernels, at the head's width, measured faster here
    and gave torch's bits in the target's forwards), the head runs in bfloat16 on the CPU,
    and a probe call of the head (3 pairs, random inputs) gives the same outputs bit for bit
    fused and not. Prints the decision where it fuses; returns it."""
    log = sys.stderr if log is None else log
    p = next(head.parameters())
    on = (isinstance(target, torch.nn.Module) and lean_capable(base_model(target))
          and glue_fused(base_model(target)) and p.dtype == torch.bfloat16 and p.device.type == "cpu"
          and _head_glue_same(head))
    head.fuse_glue(on)
    if on:
        print("draft head: norms, residual sum and rotary embedding fused as the target's (the same "
              "outputs bit for bit)", file=log)
    return on


def _head_glue_same(head: Eagle3Head, pairs: int = 3) -> bool:
    """Whether one call of ``head`` over ``pairs`` new pairs (random embeddings and target
    features, a causal block) gives the same hidden states, keys, values and draft logits
    with its glue fused as without."""
    cfg, p = head.config, next(head.parameters())
    g = torch.Generator().manual_seed(0)
    embeds = torch.randn(pairs, cfg.hidden_size, generator=g).to(p.dtype)
    feats = torch.randn(pairs, 3 * cfg.target_hidden_size, generator=g).to(p.dtype)
    positions = torch.arange(pairs)
    allowed = torch.ones(pairs, pairs, dtype=torch.bool).tril()
    before = head.glue_fused
    outs = []
    try:
        with torch.no_grad():
            for on in (False, True):
                head.fuse_glue(on)
                hidden, (k, v) = head(embeds, feats, positions, None, allowed, pairs)
                outs.append((hidden, k, v, head.draft_logits(hidden)))
    finally:
        head.fuse_glue(before)
    return all(torch.equal(a, b) for a, b in zip(*outs))


def speed_tag(model) -> str:
    """What, beyond its dtype, changes a model's latencies: ``' packed'`` when its linear
    weights are packed, ``' few-rows'`` or ``' packed few-rows'`` when its few-row products
    run the numba kernel (``pack_if_it_pays``; with the kernel's version), ``' fold-rows'``
    / ``' fold-batches'`` when its masked several-token forwards of one row / of batches
    fold the query heads (``gqa_attention.fold_pays``), ``' lean'`` when its decoder runs
    ``lean_llama.lean_forward`` (no transformers dispatch per layer; ``' lean glue'`` with
    its glue fused, ``fuse_glue_if_it_pays``), ``' glue'`` for an EAGLE-3 head whose glue
    runs fused (``fuse_head_glue``), else ``''``. Part of the latency caches' keys."""
    modules = model.modules() if isinstance(model, torch.nn.Module) else ()
    kinds = sorted({m.kind for m in modules if isinstance(m, PackedLinear)})
    few = any("few-rows" in k for k in kinds)
    tag = "".join(f" {k}" for k in kinds) + (f" ({few_row_kernel.VERSION})" if few else "")
    if isinstance(model, torch.nn.Module) and hasattr(model, "config") and gqa_pays(model):
        tag += "".join(f" fold-{name}" for name, rows in (("rows", 1), ("batches", 2)) if fold_pays(model, rows))
    if isinstance(model, torch.nn.Module) and hasattr(model, "config") and lean_note(model) is not None:
        tag += " lean" + (" glue" if glue_fused(base_model(model)) else "")
    if isinstance(model, Eagle3Head) and model.glue_fused:
        tag += " glue"
    return tag


#: ``fuse_glue_if_it_pays``' cache file (under ``rheoplan.costmodel.cache_dir()``)
GLUE_CACHE = "glue.json"


def fuse_glue_if_it_pays(model, what: str, log=None) -> bool:
    """Fuse the decoder glue of ``model`` (``lean_llama.fuse_glue``: norms, residual sums
    and rotary embedding in one numba call each) where its lean forwards run in bfloat16
    on the CPU, ``probe.glue_timings`` measured them faster fused and the fused forwards gave
    the same hidden states bit for bit (the kernels' norms sum in torch's order where they
    found it, ``decoder_glue.cpu.summation_lanes``); cached per machine, torch version, threads,
    model, its products (``speed_tag``) and the kernels' sources (``RHEOPLAN_REMEASURE=1``
    measures again). Prints the decision; returns whether the glue is fused."""
    log = sys.stderr if log is None else log
    base = base_model(model)
    p = next(model.parameters())
    if p.dtype != torch.bfloat16 or p.device.type != "cpu" or not lean_capable(base) or not glue_kernels.norm_applies():
        return False
    key = cache_key("glue", model_identity(model), p.device, dtype="bfloat16", products=speed_tag(model).strip(),
                    kernels=source_digest()[:12])
    rec = None if remeasure_requested() else cache_read(GLUE_CACHE, key)
    if not (rec and isinstance(rec.get("unfused"), list) and isinstance(rec.get("fused"), list)
            and type(rec.get("same")) is bool):
        unfused, fused, same = glue_timings(model)
        rec = {"unfused": unfused, "fused": fused, "same": same}
        cache_write(GLUE_CACHE, key, rec)
    probes = ", ".join(f"{r}x{t}" for r, t in GLUE_PROBES)
    timed = f"{sum(rec['fused']):.1f} against {sum(rec['unfused']):.1f} ms for forwards of {probes} tokens"
    pays = rec["same"] and sum(rec["fused"]) < sum(rec["unfused"])
    fuse_glue(base, pays)
    if pays:
        print(f"{what}: norms, residual sums and rotary embedding fused into one numba call each "
              f"({timed}; the same outputs bit for bit)", file=log)
    elif not rec["same"]:
        print(f"{what}: decoder glue kept as torch operators (the fused forwards' outputs differed from "
              "theirs here)", file=log)
    else:
        print(f"{what}: decoder glue kept as torch operators (fused measured no faster here: {timed})", file=log)
    return pays


#: a verify forward of the largest measured tree (64 tokens) that costs at most this many
#: one-token forwards counts as flat (``large_tree_note``). On the 2-core Zen 4 EPYC it costs
#: 3.2 (SmolLM2, bfloat16), and there the default caps are what pays: wider ones planned trees
#: about as large and ran 0.5% slower at T = 1 and 8% slower at T = 0 on the Zen 4 EPYC. Where
#: the price is flat, the caps bind: with this machine's price made flat the default caps
#: accepted 2.30 tokens a step at T = 1 and 12 / 12 / 128 accepted 2.56 (docs/results.md, "The
#: cost model's trees where a verify forward is flat").
FLAT_VERIFY_RATIO = 1.25
#: what ``large_tree_note`` suggests: frontier, slots, budget
LARGE_TREE = (12, 12, 128)


def large_tree_note(timings: Timings, tree: TreeConfig) -> str | None:
    """A line for stderr where this machine's verify forward is flat (``FLAT_VERIFY_RATIO``)
    and a cap of the largest tree the cost model may plan (``tree``: its budget, the nodes
    each depth expands and their children) is below ``LARGE_TREE``, saying that larger
    caps may pay; None elsewhere. A
    suggestion, not a change: the caps stay what the user asked for."""
    n, r = timings.verify_growth()
    f, k, b = LARGE_TREE
    if tree.frontier == 1 and tree.slots == 1:
        return None  # a chain: no width to widen
    if r > FLAT_VERIFY_RATIO or (tree.budget >= b and tree.frontier >= f and tree.slots >= k):
        return None
    return (f"cost model: a {n}-token verify forward costs {r:.2f}x a one-token one here, so trees larger than "
            f"the {tree.budget} nodes ({tree.frontier} expanded a depth, {tree.slots} children each) it may plan "
            f"could pay: try --frontier {f} --slots {k} --budget {b} and compare tokens/s (docs/cli.md, \"Where a "
            "large tree costs what a small one does\")")


def auto_tree(tree: TreeConfig, depth, budget) -> TreeConfig:
    """The largest tree the cost model may plan: ``depth`` / ``budget`` ints or ``'auto'``
    (AUTO_DEPTH levels; AUTO_BUDGET nodes, at most what the tree can hold)."""
    d = AUTO_DEPTH if depth == "auto" else depth
    cap = tree.with_(depth=d, budget=1).capacity - 1
    b = min(AUTO_BUDGET, cap) if budget == "auto" else budget
    return tree.with_(depth=d, budget=b)


def load_cost_model(model, tok, draft, tree: TreeConfig, *, draft_id: str = "",
                    calibration: str | None = None, sampling: SamplingConfig | None = None,
                    batched: bool = True) -> CostModel:
    """The cost model for ``model`` + ``draft`` with trees up to ``tree``: latencies measured
    on this machine (a few seconds the first time, then read from the cache) and the prior
    calibration a decode starts from: ``calibration`` (a JSON file written by
    ``--save-calibration``); without one, the draft head's own priors per temperature
    (``calibration.json`` in an ``eagle3`` head's directory, made by ``rheoplan calibrate``;
    ``draft_id`` is the ``--draft`` spec that names it); ``'none'``: no prior at all.
    The loop's bookkeeping is measured with ``sampling`` when it samples, else at T = 1.

    ``batched=False``: the cost model will plan one prompt at a time, so where nothing is
    cached only what one row's steps cost is measured, not the batched forwards and steps
    (a first measurement of 11.5-12.8 s against 42.7-44.8 s on a 2-core Intel Xeon,
    ``examples/measure_first_cost_model.py``). A cached record of one row serves first (a
    batched measurement writes one as well: its own one-row part), then a batched one. A
    decode of several prompts with such a model prices its batches as one row of all their
    tokens (``Timings.verify_batch``)."""
    if not isinstance(batched, bool):
        raise TypeError(f"batched={batched!r}: allowed True or False")
    prior = Calibration.load(calibration) if calibration not in (None, "none") else None
    priors: tuple = ()
    if calibration is None:
        path = head_priors_path(draft_id)
        if path is not None:
            priors = tuple(sorted(load_priors(path).items()))
            print(f"cost model: acceptance priors from {path} (temperatures "
                  f"{', '.join(f'{t:g}' for t, _ in priors)})", file=sys.stderr)
    ids = encode_prompt(tok, PROBE_PROMPT, chat=True)
    head = getattr(draft, "head", None)
    if head is not None:  # a head in another dtype (or packed) has other latencies
        draft_id = f"{draft_id} ({model_dtype(head)}{speed_tag(head)})"
    # The bookkeeping is measured with a sampled law, whatever ``sampling`` is: one cached
    # record serves every decode, and a greedy walk (an argmax per node, no draw) is the
    # cheaper, so greedy steps are priced a little high. Priced with their own bookkeeping
    # (measured apart), greedy decodes ran no faster (docs/results.md, thirteenth round).
    if sampling is None or sampling.greedy:
        sampling = SamplingConfig()
    kw = dict(tree=tree, sampling=sampling, model_id=SMOLLM2_ID + speed_tag(model), draft_id=draft_id)
    if batched:
        tm = measure_timings(model, draft, ids, **kw)
    else:  # one row's record (a batched measurement writes one too), else a batched one, else measure
        tm = (measure_timings(model, draft, ids, batch_sizes=(), cached_only=True, **kw)
              or measure_timings(model, draft, ids, cached_only=True, **kw)
              or measure_timings(model, draft, ids, batch_sizes=(), **kw))
    note = large_tree_note(tm, tree)
    if note is not None:
        print(note, file=sys.stderr)
    return CostModel(tm, prior, priors)


#: new tokens (per row) of ``warm_up``'s untimed decode
WARM_UP_TOKENS = 8
#: a warm-up longer than this many seconds compiled kernels; the command line says so (a
#: fresh process's warm-up with every kernel cached took 1.8 s on a 2-core AMD EPYC)
WARM_UP_NOTE_S = 5.0


def warm_up(model, tok, draft, *, sampling: SamplingConfig, tree: TreeConfig, cost_model: CostModel | None = None,
            backend: str = "auto", rows: int = 1) -> float:
    """Decode ``WARM_UP_TOKENS`` new tokens of ``PROBE_PROMPT`` (``rows`` copies of it,
    through ``rheoplan.stream.decode_requests``, when ``rows`` > 1) with the settings of the
    decode to come, untimed and thrown away; return its wall seconds.

    Why: numba compiles each kernel at its first call. The compiled code is cached on disk
    (``__pycache__`` beside the sources, or ``NUMBA_CACHE_DIR``), but the first decode in a
    fresh environment compiled its plan, walk and commit kernels as it ran and was reported
    as 3.4 tok/s where runs with the kernels compiled read 24-31 (a 2-core AMD EPYC; the
    warm-up took 41.6 s there, docs/cli.md). A greedy and a sampled decode compile
    different kernels, hence the same ``sampling``.
    With the kernels cached the warm-up took 1.8 s in a fresh process (0.35 s run again).
    It leaves no state behind that changes the decode after it: every decode starts from
    its own copy of the cost model's calibration, and its draft and cache from the prompt."""
    if not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows={rows!r} is out of range: allowed an int >= 1")
    ids = encode_prompt(tok, PROBE_PROMPT, chat=True)
    t0 = time.perf_counter()
    if rows == 1:
        plan_and_decode(model, draft, ids, max_new_tokens=WARM_UP_TOKENS, sampling=sampling, tree=tree, seed=0,
                        cost_model=cost_model, backend=backend)
    else:
        for _ in decode_requests(model, draft, [ids] * rows, max_batch_size=rows, max_new_tokens=WARM_UP_TOKENS,
                                 sampling=sampling, tree=tree, seed=0, cost_model=cost_model, backend=backend):
            pass
    return time.perf_counter() - t0


def head_priors_path(draft_spec: str) -> Path | None:
    """The priors file (``costmodel.PRIORS_FILE``) of the EAGLE-3 head a ``--draft`` spec
    names, if it has one; None for other drafts or specs that name none."""
    try:
        kind, arg = parse_draft_spec(draft_spec)
    except ValueError:
        return None
    p = Path(arg) / PRIORS_FILE
    return p if kind == "eagle3" and p.is_file() else None


def encode_prompt(tok, prompt: str, chat: bool) -> list[int]:
    """Token ids of ``prompt``; with ``chat`` (and a tokenizer with a chat template) as one
    user turn followed by the assistant's generation prompt."""
    if chat and getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
    return tok(prompt)["input_ids"]


def model_dtype(model) -> str:
    """``'float32'``, ``'bfloat16'``...: a model's dtype as run records and reports name it."""
    return str(next(model.parameters()).dtype).removeprefix("torch.")
