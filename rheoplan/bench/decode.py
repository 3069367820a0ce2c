"""Side-by-side decode benchmark on SmolLM2-135M-Instruct (``rheoplan bench decode``).

Every method runs in one process over the same held-out prompts (not used in
training), temperatures and seeds, with the same node budget, interleaved prompt by
prompt: at one temperature and seed, every method decodes prompt j before any starts
prompt j + 1 (the methods' order rotates per prompt), so a machine that slows down
mid-benchmark slows every method alike:

* ``ar-hf``: autoregressive sampling with transformers ``generate`` (dynamic cache, eager)
  on the loaded model, whose bfloat16 linear weights the loader packs for oneDNN where that
  pays (``rheoplan.models.packed_linear``): ``generate`` gets that speed too
* ``ar-hf-unpacked``: the same ``generate`` with the linear weights as transformers loads
  them (unpacked for its run, packed again after): what a user has without rheoplan
* ``ar-hf-f32``: ``ar-hf`` on a float32 copy of the model (``float32_model``; the model
  itself when it is float32): in a bfloat16 run, the float32 ``generate`` a user may have
  instead, timed interleaved with the rest
* ``default``: what ``rheoplan generate`` does by default: RheoSampling (m = 1, ``rheo``)
  with the cost model planning every tree (``--depth auto --budget auto``); its rows
  also show the cost model's predicted tokens per step next to the measured ones
* ``default-ot``: the same with the ``ot`` verifier (``--verifier ot``)
* ``ar-hf-static``: ``generate`` on its own fast path: a static cache and a
  ``torch.compile``d forward (compiled once per dtype before the clock starts; the compile
  time is recorded; if compiling fails on this machine the run records why instead); on
  a model with packed linear weights it runs on an unpacked copy (``static_model``:
  inductor cannot lower prepacked oneDNN weights)
* ``chain``: chain speculative sampling (depth D, one sampled token per depth)
* ``eagle``: EAGLE's dynamic top-K tree with one-hot verification
* ``rheo-m{m}-{verifier}[-{proxy}]``: RheoSampling variants

Each (method, temperature, seed) run is written to ``OUT/runs/*.json`` as soon as its
(temperature, seed) group finishes, so an interrupted benchmark resumes at the first
unfinished group (``--resume``, the default). ``--report`` turns whatever runs exist into ``docs/results.md``-style
markdown and PNG plots. Every method's speed-up is against the FASTEST ``generate``
variant of the same dtype and temperature, and, in a second column, against the fastest
``generate`` of any dtype at that temperature (``ar-hf-f32`` and runs of other dtypes
included); the report names the CPU and its flags.

    rheoplan bench decode --prompts 40 --tokens 48 --seeds 0 1 2 --temperatures 0 0.6 1.0
"""

from __future__ import annotations

import argparse
import copy
import json
from contextlib import nullcontext
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Sequence
from pathlib import Path

import torch

from tqdm.auto import tqdm

from rheoplan.bench.phases import PHASES, breakdown
from rheoplan.config import SamplingConfig, TreeConfig
from rheoplan.costmodel import machine_name
from rheoplan.decode import plan_and_decode
from rheoplan.loading import (DRAFT_DTYPES, FIXED_TREE, WARM_UP_TOKENS, auto_tree, encode_prompt, load_cost_model,
                              load_default, model_dtype)
from rheoplan.models.packed_linear import PackedLinear, unpacked
from rheoplan.probe import packed_copy

HELDOUT = Path(__file__).resolve().parents[1] / "data" / "prompts_heldout.txt"


@dataclass(frozen=True)
class Method:
    name: str
    tree: TreeConfig | None  #: None = transformers generate
    kind: str = "rheoplan"  #: 'rheoplan' or one of GENERATE_KINDS
    cost: bool = False  #: plan by the cost model (``tree`` is the largest shape)


GENERATE_KINDS = ("generate", "generate-unpacked", "generate-static", "generate-float32")


def methods_for(depth: int, frontier: int, slots: int, budget: int) -> dict[str, Method]:
    """All benchmarked methods at one node budget."""
    base = TreeConfig(depth=depth, frontier=frontier, slots=slots, budget=budget)
    auto = auto_tree(TreeConfig(frontier=frontier, slots=slots, rheostat=1, verifier="rheo"), "auto", "auto")
    out = {
        "default": Method("default", auto, cost=True),
        "default-ot": Method("default-ot", auto.with_(verifier="ot"), cost=True),
        "ar-hf": Method("ar-hf", None, "generate"),
        "ar-hf-static": Method("ar-hf-static", None, "generate-static"),
        "ar-hf-unpacked": Method("ar-hf-unpacked", None, "generate-unpacked"),
        "ar-hf-f32": Method("ar-hf-f32", None, "generate-float32"),
        "chain": Method("chain", TreeConfig.chain(depth=depth)),
        "eagle": Method("eagle", TreeConfig.eagle(depth=depth, frontier=frontier, slots=slots, budget=budget)),
    }
    for m in (0, 1, 2):
        for verifier in ("rheo", "ot"):
            out[f"rheo-m{m}-{verifier}"] = Method(f"rheo-m{m}-{verifier}",
                                                  base.with_(rheostat=m, verifier=verifier))
    for proxy in ("next_rank", "true_q"):
        out[f"rheo-m1-ot-{proxy}"] = Method(f"rheo-m1-ot-{proxy}", base.with_(rheostat=1, proxy=proxy))
    return out


def load_prompts(n: int) -> list[tuple[str, str]]:
    rows = []
    for line in HELDOUT.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            cat, _, prompt = line.partition("\t")
            rows.append((cat, prompt))
    if not 1 <= n <= len(rows):
        raise ValueError(f"--prompts={n} is out of range: allowed [1, {len(rows)}]")
    # Interleave categories so a small n still covers all of them.
    by_cat: dict[str, list] = {}
    for r in rows:
        by_cat.setdefault(r[0], []).append(r)
    mixed = [r for group in zip(*by_cat.values()) for r in group]
    mixed += [r for r in rows if r not in mixed]
    return mixed[:n]


def check_run_args(tokens: int, threads: int | None) -> None:
    """Checks every benchmark shares, made before the model loads."""
    if tokens < 1:
        raise ValueError(f"--tokens={tokens}: allowed >= 1")
    if threads is not None and threads < 1:
        raise ValueError(f"--threads={threads}: allowed >= 1")


def plan_runs(names: list[str], temperatures: list[float], seeds: list[int]) -> list[tuple[str, float, int]]:
    """The (method, temperature, seed) runs to do, in order.

    At T = 0 every RheoSampling variant is EAGLE's tree (no slot is sampled), so one
    variant (``rheo-m1-ot``) stands for all of them. Greedy tokens do not depend on the
    seed, but each seed still repeats the timing: that is what the spread at T = 0 shows.
    """
    return [(n, t, s) for t in temperatures for s in seeds for n in names
            if not (t == 0 and n.startswith("rheo-") and n != "rheo-m1-ot")]


#: static-cache length for ``ar-hf-static``: one fixed shape for every prompt, so the
#: compiled forward is not recompiled per prompt length
STATIC_CACHE_LEN = 1024


def static_generate_kwargs(model, needed: int) -> dict:
    """``generate`` kwargs for transformers' own fast path on any device: a fresh static
    cache of one fixed length and a compiled forward (transformers compiles only on GPUs
    unless the compile config says all devices)."""
    from transformers import CompileConfig, StaticCache

    if needed > STATIC_CACHE_LEN:
        raise ValueError(f"prompt + tokens = {needed} exceeds the static cache ({STATIC_CACHE_LEN})")
    cc = CompileConfig(fullgraph=True, mode="default")
    cc._compile_all_devices = True  # transformers' switch for compiling off-GPU
    return {"cache": StaticCache(config=model.config, max_cache_len=STATIC_CACHE_LEN),
            "compile_config": cc}


#: (id(model), what) -> (model, its copy) for the ``generate`` variants that run on a copy
#: of the loaded model (``static_model``, ``float32_model``)
_TWINS: dict[tuple[int, str], tuple] = {}


def _twin(model, what: str, make):
    """The copy of ``model`` made by ``make()`` for ``what``, made once per process (a
    ``model`` freed and another allocated at its address gets a fresh copy)."""
    held = _TWINS.get((id(model), what))
    if held is None or held[0] is not model:
        held = _TWINS[id(model), what] = (model, make())
    return held[1]


def static_model(model):
    """The model ``ar-hf-static`` runs: ``model`` itself, or for a model with packed linear
    weights an unpacked copy of it (the same weights, made once per process). Inductor
    cannot lower oneDNN's prepacked weights (a ``LoweringException``), and unpacking the
    original around each call would give the compiled graph new modules, so a recompile,
    every prompt."""
    if not any(isinstance(m, PackedLinear) for m in model.modules()):
        return model

    def make():
        with unpacked(model):
            return copy.deepcopy(model)
    return _twin(model, "static", make)


def float32_model(model):
    """The model ``ar-hf-f32`` runs: ``model`` itself when it is float32, else a float32
    copy made once per process, its linear weights packed where that pays (as the loader
    runs float32). The copy's weights are ``model``'s widened (a bfloat16 model's rounding
    kept), so its tokens are not the float32 load's; its speed is float32's, which is what
    it is for."""
    if model_dtype(model) == "float32":
        return model

    def make():
        with unpacked(model):  # a packed weight cannot be deep-copied
            return packed_copy(model, torch.float32)
    return _twin(model, "float32", make)


def warm_static_generate(model, tok) -> tuple[float, str | None]:
    """Compile ``generate``'s static-cache forward before any clock starts (greedy and
    sampled share it): ``(seconds, None)``, or ``(seconds, why it failed)``."""
    t0 = time.perf_counter()
    model = static_model(model)
    try:
        ids = torch.tensor([[tok.eos_token_id or 0] * 4])
        with torch.no_grad():
            for _ in range(2):  # the second call checks that nothing recompiles badly
                model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                               pad_token_id=tok.eos_token_id, **static_generate_kwargs(model, 8))
    except Exception as exc:  # report, do not crash the benchmark
        return time.perf_counter() - t0, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    return time.perf_counter() - t0, None


def machine_info() -> dict:
    """What the report says about the machine: CPU model, the SIMD/matrix flags that
    matter for these kernels, threads and library versions."""
    import transformers  # only for its version; the benchmark needs it anyway

    flags: list[str] = []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                flags = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni",
                                     "amx_tile", "amx_bf16", "amx_int8") if f in have]
                break
    except OSError:
        pass
    return {"cpu": machine_name("cpu"), "flags": flags, "threads": torch.get_num_threads(),
            "cores": __import__("os").cpu_count(), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version()}


def decode_prompt(model, tok, draft, method: Method, ids: list[int], temperature: float, seed: int, tokens: int,
                  cost_model=None) -> tuple[int, int, float, object]:
    """One prompt with one method: ``(new tokens, steps, seconds, DecodeResult or None)``.

    ``generate`` methods draw from the global generator seeded with ``seed`` (their steps
    are their tokens; no result); rheoplan methods decode with ``seed`` and the cost model
    when the method plans by it."""
    if method.kind in GENERATE_KINDS:
        torch.manual_seed(seed)
        kw = dict(do_sample=True, temperature=temperature) if temperature > 0 else dict(do_sample=False)
        gen = model
        if method.kind == "generate-static":
            gen = static_model(model)
            kw.update(static_generate_kwargs(gen, len(ids) + tokens))
        elif method.kind == "generate-float32":
            gen = float32_model(model)
        with unpacked(model) if method.kind == "generate-unpacked" else nullcontext():
            t0 = time.perf_counter()
            with torch.no_grad():
                out = gen.generate(torch.tensor([ids]), max_new_tokens=tokens, min_new_tokens=tokens,
                                     top_k=0, top_p=1.0, pad_token_id=tok.eos_token_id, **kw)
            sec = time.perf_counter() - t0
        new = out.shape[1] - len(ids)
        return new, new, sec, None
    t0 = time.perf_counter()
    r = plan_and_decode(model, draft, ids, max_new_tokens=tokens, sampling=SamplingConfig(temperature=temperature),
                        tree=method.tree, seed=seed, cost_model=cost_model if method.cost else None)
    return len(r.tokens), len(r.steps), time.perf_counter() - t0, r


class _Tally:
    """What one (method, temperature, seed) run adds up over its prompts."""

    def __init__(self, method: Method, draft):
        self.method, self.draft = method, draft
        self.n_tok = self.n_steps = self.acc = self.trials = self.ar_steps = 0
        self.seconds = 0.0
        self.phases: dict[str, float] = {}  # plan_and_decode's per-phase seconds, summed over prompts
        self.predicted: list[float] = []

    def add(self, new: int, steps: int, sec: float, r) -> None:
        self.seconds += sec
        self.n_tok += new
        self.n_steps += steps
        if r is None:
            return
        self.predicted += [st.predicted_tokens for st in r.steps if st.predicted_tokens is not None]
        self.ar_steps += sum(1 for st in r.steps if not st.drafted)
        self.acc += sum(s.accepted for s in r.steps)
        self.trials += sum(s.trials for s in r.steps)
        for k, v in r.phase_totals().items():
            self.phases[k] = self.phases.get(k, 0.0) + v
        # the steps' own wall time: what is left of ``seconds`` is the prompts' prefill
        self.phases["step"] = self.phases.get("step", 0.0) + sum(st.t_step for st in r.steps)

    def record(self, model, temperature: float, seed: int, prompts: int) -> dict:
        m, d = self.method, self.draft
        return {"method": m.name, "temperature": temperature, "seed": seed, "prompts": prompts,
                "tokens": self.n_tok, "steps": self.n_steps, "seconds": self.seconds,
                "tokens_per_second": self.n_tok / self.seconds if self.seconds else float("nan"),
                "mean_accepted_length": self.n_tok / self.n_steps if self.n_steps else float("nan"),
                "acceptance": self.acc / self.trials if self.trials else float("nan"),
                "phase_seconds": self.phases,
                "predicted_tokens_per_step": (sum(self.predicted) / len(self.predicted)
                                              if self.predicted else None),
                "autoregressive_steps": self.ar_steps if m.cost else None,
                "tree": None if m.tree is None else m.tree.as_dict(),
                "dtype": model_dtype(model), "threads": torch.get_num_threads(),
                # the dtype generate ran in (``ar-hf-f32``: float32 in any run); None for rheoplan
                "generate_dtype": (("float32" if m.kind == "generate-float32" else model_dtype(model))
                                   if m.kind in GENERATE_KINDS else None),
                "draft_dtype": model_dtype(d.head) if hasattr(d, "head") and m.tree is not None else None}


def run_group(model, tok, runs: Sequence[tuple[Method, object]], prompts, temperature: float, seed: int,
              tokens: int, cost_model=None) -> list[dict]:
    """``(method, draft)`` runs at one temperature and seed, interleaved prompt by prompt:
    every run decodes prompt j before any starts prompt j + 1, and the runs' order rotates
    by one per prompt, so a machine that slows down mid-benchmark slows every run alike.
    Returns one aggregate record per run, in ``runs``' order. ``cost_model`` (a
    ``rheoplan.costmodel.CostModel``) is needed for a ``cost`` method. Prompt j decodes
    with seed ``seed * 1000 + j`` in every run. Before the clock starts, each run decodes
    ``WARM_UP_TOKENS`` tokens of the first prompt, untimed."""
    for method, _ in runs:
        if method.cost and cost_model is None:
            raise ValueError(f"method {method.name!r} plans by the cost model: pass cost_model=")
    tallies = [_Tally(m, d) for m, d in runs]
    # the warm-up: the first decode of a kind compiles its numba kernels in a fresh
    # environment (41.6 s on a 2-core AMD EPYC), which would land in one prompt's time
    # (``rheoplan.loading.warm_up`` does the same for the command line)
    if prompts:
        ids = encode_prompt(tok, prompts[0][1], chat=True)
        for t in tallies:
            decode_prompt(model, tok, t.draft, t.method, ids, temperature, seed, WARM_UP_TOKENS, cost_model=cost_model)
    for j, (_, prompt) in enumerate(prompts):
        ids = encode_prompt(tok, prompt, chat=True)
        for i in range(len(tallies)):
            t = tallies[(i + j) % len(tallies)]
            t.add(*decode_prompt(model, tok, t.draft, t.method, ids, temperature, seed * 1000 + j, tokens,
                                 cost_model=cost_model))
    return [t.record(model, temperature, seed, len(prompts)) for t in tallies]


def run_one(model, tok, draft, method: Method, prompts, temperature: float, seed: int, tokens: int,
            cost_model=None) -> dict:
    """One (method, temperature, seed) run over all prompts (``run_group`` of one run)."""
    return run_group(model, tok, [(method, draft)], prompts, temperature, seed, tokens, cost_model)[0]


def _groups(records: list[dict]) -> dict[tuple, list[dict]]:
    """The records by (method, temperature, dtype)."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        # records from before the dtype field were all float32
        groups.setdefault((r["method"], r["temperature"], r.get("dtype", "float32")), []).append(r)
    return groups


def _generate_per_seed(groups: dict[tuple, list[dict]]) -> dict[tuple, float]:
    """(temperature, dtype, seed) -> tokens/s of the fastest ``generate`` variant run in
    that dtype with that seed: the baseline a run of the same seed was interleaved with."""
    out: dict[tuple, float] = {}
    for (m, t, d), rs in groups.items():
        if m.startswith("ar-hf") and not any(x.get("error") for x in rs) and (rs[0].get("generate_dtype") or d) == d:
            for x in rs:
                key = (t, d, x.get("seed"))
                out[key] = max(out.get(key, 0.0), x["tokens_per_second"])
    return out


def summarise(records: list[dict]) -> list[dict]:
    """Median and spread (min-max) over seeds for each (method, temperature), and the
    speed-ups: the median's against the fastest ``generate`` median (``speedup``,
    ``speedup_any``) and, per seed, the run's against the fastest ``generate`` of the same
    seed (``speedup_seeds``, in seed order): the runs of one seed share their prompts and
    were timed interleaved, prompt by prompt, so that ratio does not mix two spells of the
    machine, as a ratio of medians over seeds can."""
    groups = _groups(records)
    # the baselines: the FASTEST generate variant of the same temperature and dtype, and
    # the fastest of any dtype at that temperature (what a user without rheoplan could pick)
    ar: dict[tuple, float] = {}
    ar_any: dict[float, float] = {}
    for (m, t, d), rs in groups.items():
        if m.startswith("ar-hf") and not any(x.get("error") for x in rs):
            med = statistics.median(x["tokens_per_second"] for x in rs)
            if (rs[0].get("generate_dtype") or d) == d:
                ar[t, d] = max(ar.get((t, d), 0.0), med)
            ar_any[t] = max(ar_any.get(t, 0.0), med)
    ar_seed = _generate_per_seed(groups)
    rows = []
    for (m, t, d), rs in sorted(groups.items(), key=lambda kv: (kv[0][2] != "float32", kv[0][2], kv[0][1], kv[0][0])):
        def stat(key):
            xs = [x[key] for x in rs]
            return statistics.median(xs), min(xs), max(xs)
        errors = [x["error"] for x in rs if x.get("error")]
        if errors:
            rows.append({"method": m, "temperature": t, "dtype": d, "seeds": len(rs), "error": errors[0]})
            continue
        tau, acc, tps = stat("mean_accepted_length"), stat("acceptance"), stat("tokens_per_second")
        pred = [x["predicted_tokens_per_step"] for x in rs if x.get("predicted_tokens_per_step") is not None]
        rows.append({"method": m, "temperature": t, "dtype": d, "seeds": len(rs), "tau": tau, "acceptance": acc,
                     "tps": tps, "speedup": tps[0] / ar[t, d] if (t, d) in ar else float("nan"),
                     "speedup_any": tps[0] / ar_any[t] if t in ar_any else float("nan"),
                     "speedup_seeds": tuple(x["tokens_per_second"] / ar_seed[t, d, x.get("seed")]
                                            for x in sorted(rs, key=lambda x: x.get("seed") or 0)
                                            if (t, d, x.get("seed")) in ar_seed),
                     "predicted_tau": statistics.median(pred) if pred else float("nan"),
                     "compile_seconds": max((x.get("compile_seconds") or 0.0) for x in rs)})
    return rows


#: ``step_rows``' quantities (``rheoplan.bench.phases.breakdown``), in the table's order
STEP_COLUMNS = ("step_ms", "draft", "plan", "verify_forward", "walk", "projection_ms", "commit", "loop_other_ms",
                "bookkeeping_ms", "bookkeeping_no_projection_ms", "depth_vs_head_forward", "break_even_tau",
                "tau_for_1_3x")


def step_rows(records: list[dict]) -> list[dict]:
    """Where the speculative runs' steps go: per (method, temperature, dtype), the median
    over seeds of each ``STEP_COLUMNS`` quantity of ``breakdown`` (ms per step by phase,
    the per-step bookkeeping and a drafted depth against its draft call, and the accepted
    length that would break even with, or run 1.3x, the fastest ``generate`` of the same
    seed). Runs without phase times (``generate``) or without a ``generate`` of their seed
    are left out."""
    groups = _groups(records)
    ar_seed = _generate_per_seed(groups)
    rows = []
    for (m, t, d), rs in sorted(groups.items(), key=lambda kv: (kv[0][2], kv[0][1], kv[0][0])):
        if m.startswith("ar-hf"):  # generate: the baseline, no phases
            continue
        bs = []
        for x in rs:
            base = ar_seed.get((t, d, x.get("seed")))
            if x.get("error") or not x.get("phase_seconds") or not x.get("steps") or not base:
                continue
            b = breakdown(x, 1e3 / base)
            b.update({k: b["phase_ms"][k] for k in PHASES})
            if "bookkeeping_ms" in b:
                b["bookkeeping_no_projection_ms"] = b["bookkeeping_ms"] - b["projection_ms"]
            bs.append(b)
        if not bs:
            continue
        med = {}
        for k in STEP_COLUMNS:  # a quantity some run lacks (no draft calls: no depth ratio) stays out
            vals = [b[k] for b in bs if k in b]
            if len(vals) == len(bs):
                med[k] = statistics.median(vals)
        rows.append({"method": m, "temperature": t, "dtype": d, "seeds": len(bs), **med})
    return rows


def step_table(records: list[dict]) -> str:
    """``step_rows`` as a markdown table (empty when no run has phase times)."""
    rows = step_rows(records)
    if not rows:
        return ""
    f = lambda r, k, fmt="{:.2f}": fmt.format(r[k]) if k in r else "–"  # noqa: E731
    lines = ["| dtype | T | method | seeds | ms/step | draft | plan | verify forward | walk (output projection) | "
             "commit | loop | plan + walk + commit + loop (without the projection) | drafted depth / draft call | "
             "tau to break even / for 1.3x |", "|---" * 14 + "|"]
    for r in rows:
        book = f"{f(r, 'bookkeeping_ms')} ({f(r, 'bookkeeping_no_projection_ms')})"
        lines.append(f"| {r['dtype']} | {r['temperature']} | {r['method']} | {r['seeds']} | {f(r, 'step_ms')} | "
                     f"{f(r, 'draft')} | {f(r, 'plan')} | {f(r, 'verify_forward')} | {f(r, 'walk')} "
                     f"({f(r, 'projection_ms')}) | {f(r, 'commit')} | {f(r, 'loop_other_ms')} | {book} | "
                     f"{f(r, 'depth_vs_head_forward', '{:.2f}x')} | {f(r, 'break_even_tau')} / {f(r, 'tau_for_1_3x')} |")
    return "\n".join(lines)


def _fmt(v, spread=None, pct=False):
    if v != v:  # NaN
        return "–"
    f = (lambda x: f"{100 * x:.1f}%") if pct else (lambda x: f"{x:.2f}")
    return f(v) if spread is None or spread[0] == spread[1] else f"{f(v)} ({f(spread[0])}–{f(spread[1])})"


def per_seed_note(speedups) -> str:
    """`` (per seed 1.28, 1.31)``: what the tables put after a median speed-up of several
    seeds (``summarise``'s ``speedup_seeds``, also ``rheoplan bench batch``'s); nothing
    for fewer than two."""
    xs = tuple(speedups or ())
    return "" if len(xs) < 2 else " (per seed " + ", ".join(f"{x:.2f}" for x in xs) + ")"


def report(records: list[dict], out_md: Path, plot_dir: Path) -> str:
    rows = summarise(records)
    lines = []
    machines = {json.dumps(r["machine"], sort_keys=True) for r in records if r.get("machine")}
    for mj in sorted(machines):
        m = json.loads(mj)
        lines.append(f"Machine: {m['cpu']}; flags: {' '.join(m['flags']) or 'none of avx2/avx512/amx'}; "
                     f"{m['threads']} torch threads of {m['cores']} cores; torch {m['torch']}, "
                     f"transformers {m['transformers']}.")
    compiled = sorted({"%s %.0f s" % (r["dtype"], r["compile_seconds"]) for r in rows if r.get("compile_seconds")})
    if compiled:
        lines.append(f"`ar-hf-static` compile time (once per dtype, not in tokens/s): {', '.join(compiled)}.")
    if lines:
        lines.append("")
    lines += ["| dtype | T | method | seeds | mean accepted length (predicted) | per-token acceptance | tokens/s | "
              "speed-up vs fastest generate | vs fastest generate, any dtype |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['dtype']} | {r['temperature']} | {r['method']} | {r['seeds']} | failed: "
                         f"{r['error']} | – | – | – | – |")
            continue
        pred = "" if r["predicted_tau"] != r["predicted_tau"] else f" ({r['predicted_tau']:.2f})"
        lines.append(f"| {r['dtype']} | {r['temperature']} | {r['method']} | {r['seeds']} | "
                     f"{_fmt(r['tau'][0], r['tau'][1:])}{pred} | "
                     f"{_fmt(r['acceptance'][0], r['acceptance'][1:], pct=True)} | {_fmt(r['tps'][0], r['tps'][1:])} | "
                     f"{_fmt(r['speedup'])}x{'' if r['method'].startswith('ar-hf') else per_seed_note(r['speedup_seeds'])} | "
                     f"{_fmt(r['speedup_any'])}x |")
    steps = step_table(records)
    if steps:
        lines += ["", "Where a step goes (ms per step, medians over seeds; `rheoplan.bench.phases.breakdown`; "
                  "the prompt's forward is in ms/step, not in the phases):", "", steps]
    table = "\n".join(lines)
    out_md.parent.mkdir(parents=True, exist_ok=True)
    out_md.write_text(table + "\n")
    try:
        _plots(rows, plot_dir)
    except Exception as exc:  # plots are a convenience; the table is the result
        print(f"(plots skipped: {exc})", file=sys.stderr)
    return table


def _plots(rows: list[dict], plot_dir: Path) -> None:
    rows = [r for r in rows if not r.get("error")]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plot_dir.mkdir(parents=True, exist_ok=True)
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        suffix = "" if dtype == "float32" else f"_{dtype}"  # float32 keeps the historical names
        _plot_dtype([r for r in rows if r["dtype"] == dtype], plot_dir, dtype, suffix, plt)


def _plot_dtype(rows: list[dict], plot_dir: Path, dtype: str, suffix: str, plt) -> None:
    temps = sorted({r["temperature"] for r in rows})
    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if not m.startswith("ar-hf")]
    for key, label, fname in (("tau", "mean accepted length", f"accepted_length{suffix}.png"),
                              ("speedup", "speed-up vs the fastest generate", f"speedup{suffix}.png")):
        fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(methods)), 4))
        width = 0.8 / max(1, len(temps))
        for i, t in enumerate(temps):
            vals, lo, hi = [], [], []
            for m in methods:
                r = next((r for r in rows if r["method"] == m and r["temperature"] == t), None)
                if r is None:
                    v = a = b = float("nan")
                elif key == "tau":
                    v, a, b = r["tau"]
                else:  # speedup's spread: the method's min-max tokens/s over the same median
                    v = r["speedup"]
                    a, b = (v * r["tps"][1] / r["tps"][0], v * r["tps"][2] / r["tps"][0])
                vals.append(v)
                lo.append(v - a)
                hi.append(b - v)
            ax.bar([x + i * width for x in range(len(methods))], vals, width, label=f"T={t}",
                   yerr=[lo, hi], capsize=2, error_kw={"lw": 0.8})
        ax.set_xticks([x + width * (len(temps) - 1) / 2 for x in range(len(methods))])
        ax.set_xticklabels(methods, rotation=30, ha="right")
        ax.set_ylabel(label)
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
        if key == "speedup":
            ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_title(f"SmolLM2-135M {dtype}, CPU: {label}\n(median; whiskers: min-max over seeds)", fontsize=10)
        fig.tight_layout()
        fig.savefig(plot_dir / fname, dpi=110)
        plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="rheoplan bench decode", description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=40, help="held-out prompts to use (default 40, all)")
    ap.add_argument("--tokens", type=int, default=48, help="new tokens per prompt (default 48)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.6, 1.0])
    ap.add_argument("--methods", nargs="+", default=None,
                    help="subset of methods (default: all); see the module docstring for names")
    for k in ("depth", "frontier", "slots", "budget"):
        ap.add_argument(f"--{k}", type=int, default=FIXED_TREE[k],
                        help=f"the fixed-shape methods' tree (default {FIXED_TREE[k]}; 'default' plans "
                             "its own up to --depth auto / --budget auto)")
    ap.add_argument("--draft", default="auto", help="as for rheoplan generate (default auto)")
    ap.add_argument("--dtype", nargs="+", choices=["auto", "float32", "bfloat16"], default=["float32", "auto"],
                    help="target dtypes to run, in order (default: float32 auto; 'auto' = the one "
                         "measured fastest here, run once if it is float32)")
    ap.add_argument("--draft-dtype", choices=DRAFT_DTYPES, default="auto",
                    help="the draft head's dtype, as for rheoplan generate (default auto)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", default="bench_out", help="run records and plots (default bench_out)")
    ap.add_argument("--report-md", default=None, help="write the table here too (e.g. docs/results_table.md)")
    ap.add_argument("--report", action="store_true", help="only build the report from existing runs")
    ap.add_argument("--no-resume", action="store_true", help="re-run runs that already have a record")
    args = ap.parse_args(argv)
    all_methods = methods_for(args.depth, args.frontier, args.slots, args.budget)
    names = args.methods or list(all_methods)
    unknown = [n for n in names if n not in all_methods]
    if unknown:
        raise ValueError(f"--methods: unknown {unknown}; allowed: {', '.join(all_methods)}")
    for t in args.temperatures:
        SamplingConfig(temperature=t)
    check_run_args(args.tokens, args.threads)
    prompts = load_prompts(args.prompts)
    out = Path(args.out)
    runs_dir = out / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    if args.threads:
        torch.set_num_threads(args.threads)

    if not args.report:
        machine = machine_info()
        done_dtypes: set[str] = set()
        for requested in dict.fromkeys(args.dtype):
            model, tok, draft = load_default(method="rheo", draft=args.draft, dtype=requested,
                                                  draft_dtype=args.draft_dtype)
            dtype = model_dtype(model)
            if dtype in done_dtypes:  # 'auto' picked a dtype already run
                print(f"dtype {requested} = {dtype}: already run", file=sys.stderr)
                continue
            done_dtypes.add(dtype)
            compile_s, compile_err, cost = None, None, None
            # one group per (temperature, seed): its methods run interleaved prompt by prompt
            groups: dict[tuple[float, int], list[Method]] = {}
            for n, t, s in plan_runs(names, args.temperatures, args.seeds):
                groups.setdefault((t, s), []).append(all_methods[n])
            bar = tqdm(groups.items(), desc=f"bench {dtype}", unit="group")
            for (t, s), methods in bar:
                path_of = {m.name: runs_dir / f"{m.name}_T{t}_s{s}_p{len(prompts)}_n{args.tokens}_{dtype}.json"
                           for m in methods}
                methods = [m for m in methods if args.no_resume or not path_of[m.name].exists()]
                if not methods:
                    continue
                bar.set_postfix_str(f"T={t} seed={s}: {' '.join(m.name for m in methods)}")
                if any(m.kind == "generate-static" for m in methods) and compile_s is None:
                    compile_s, compile_err = warm_static_generate(model, tok)
                costed = [m for m in methods if m.cost]
                if costed and cost is None:
                    cost = load_cost_model(model, tok, draft, costed[0].tree, draft_id=args.draft, batched=False)
                recs = {}
                if compile_err:  # report the failure, run the others
                    for m in [m for m in methods if m.kind == "generate-static"]:
                        recs[m.name] = {"method": m.name, "temperature": t, "seed": s, "dtype": dtype,
                                        "error": f"static cache + torch.compile failed here: {compile_err}"}
                runs = [(m, draft) for m in methods if m.name not in recs]
                for rec in run_group(model, tok, runs, prompts, t, s, args.tokens, cost_model=cost):
                    recs[rec["method"]] = rec
                for m in methods:
                    rec = recs[m.name]
                    if m.kind == "generate-static":
                        rec["compile_seconds"] = compile_s
                    rec["machine"] = machine
                    rec["dtype_requested"] = requested
                    path_of[m.name].write_text(json.dumps(rec, indent=1))
            del model, draft
    records = [json.loads(p.read_text()) for p in sorted(runs_dir.glob("*.json"))]
    table = report(records, Path(args.report_md) if args.report_md else out / "results_table.md", out)
    print(table)
    print(f"\nrun records in {runs_dir}/, plots in {out}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
