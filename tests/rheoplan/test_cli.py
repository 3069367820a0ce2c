"""The command line: argument errors are one clear line before any model loads; config
files are strict; mistyped commands and flags get a suggestion."""

from __future__ import annotations

import json

import pytest
from numba import njit

from rheoplan import cli
from rheoplan.decode import plan_and_decode


def run(argv, capsys):
    rc = cli.main(argv)
    err = capsys.readouterr().err
    return rc, err


@pytest.fixture(autouse=True)
def no_model_loading(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a model was loaded although the arguments were invalid")

    monkeypatch.setattr(cli, "load_default", refuse)


@pytest.mark.parametrize("argv, needle", [
    (["generate", "--temperature", "-1"], "temperature=-1.0 is out of range"),
    (["generate", "--top-p", "0"], "top_p=0.0 is out of range"),
    (["generate", "--min-p", "1.5"], "min_p=1.5 is out of range: allowed [0, 1]"),
    (["generate", "--typical-p", "0"], "typical_p=0.0 is out of range: allowed (0, 1]"),
    (["generate", "--repetition-penalty", "0"], "repetition_penalty=0.0 is out of range"),
    (["generate", "--rheostat", "9"], "rheostat=9 is out of range: allowed in [0, 3]"),
    (["generate", "-n", "0"], "--max-new-tokens=0 is out of range"),
    (["generate", "--draft", "foo"], "--draft='foo' is not understood"),
    (["generate", "--draft", "eagle3:/no/such/dir"], "is not a directory"),
    (["dump", "--method", "autoregressive"], "has no draft tree to dump"),
    (["generate", "--threads", "0"], "--threads=0 is out of range: allowed >= 1"),
    (["dump", "--threads", "-2"], "--threads=-2 is out of range: allowed >= 1"),
    (["calibrate", "--threads", "0"], "--threads=0 is out of range: allowed >= 1"),
    (["calibrate", "--prompts", "0"], "--prompts=0 is out of range: allowed >= 1"),
    (["calibrate", "--tokens", "0"], "--tokens=0 is out of range: allowed >= 1"),
    (["calibrate", "--temperatures", "1", "-1"], "--temperatures=[1.0, -1.0]: allowed numbers >= 0"),
    (["calibrate", "--max-trials", "0"], "--max-trials=0.0 is out of range: allowed > 0"),
    (["calibrate", "--depth", "4", "--budget", "8"], "calibrate needs the cost model"),
    (["calibrate", "--method", "autoregressive"], "calibrate needs the cost model"),
    (["calibrate", "--calibration", "none"], "calibrate starts from no prior"),
    (["calibrate", "--draft", "early-exit:6"], "is not an EAGLE-3 head directory: pass --out FILE"),
])
def test_bad_values_fail_before_loading(argv, needle, capsys):
    rc, err = run(argv, capsys)
    assert rc == 2 and needle in err


def test_threads_are_set_before_the_command_runs(monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(cli.torch, "set_num_threads", seen.append)
    rc, err = run(["generate", "--threads", "3", "--temperature", "-1"], capsys)
    assert rc == 2 and seen == [3]  # set first, then the command's own checks refuse the temperature


@pytest.mark.parametrize("flag, value, choices", [
    ("--dtype", "float16", "'auto', 'float32', 'bfloat16'"),
    ("--draft-dtype", "float16", "'auto', 'float32', 'bfloat16'"),
    ("--backend", "cuda", "'auto', 'reference', 'numba', 'triton'"),
])
def test_bad_choice_names_the_choices(flag, value, choices, capsys):
    with pytest.raises(SystemExit) as e:  # argparse's own choice check, before any loading
        cli.main(["generate", flag, value])
    assert e.value.code == 2
    assert f"argument {flag}: invalid choice: '{value}' (choose from {choices})" in capsys.readouterr().err


def test_draft_dtype_reaches_the_loader(capsys, monkeypatch):
    seen = {}

    def stop(**kw):
        seen.update(kw)
        raise SystemExit(0)

    monkeypatch.setattr(cli, "load_default", stop)
    with pytest.raises(SystemExit):
        cli.main(["generate", "--draft-dtype", "bfloat16", "hi"])
    assert seen["draft_dtype"] == "bfloat16"


def test_load_default_refuses_an_unknown_draft_dtype_before_loading():
    from rheoplan.loading import load_default

    with pytest.raises(ValueError, match=r"draft_dtype='fp16' is not one of \('auto', 'float32', 'bfloat16'\)"):
        load_default(draft_dtype="fp16")


@pytest.mark.parametrize("command", ["generate", "dump"])
def test_triton_backend_without_cuda_fails_before_loading(command, capsys, monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA present: --backend triton is allowed")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    rc, err = run([command, "--backend", "triton"], capsys)
    assert rc == 2 and "backend='triton' needs the target on a CUDA device" in err


def test_typo_in_flag_gets_a_suggestion(capsys):
    rc, err = run(["generate", "--temprature", "1"], capsys)
    assert rc == 2 and "did you mean --temperature?" in err


def test_typo_in_command_gets_a_suggestion(capsys):
    rc, err = run(["generat"], capsys)
    assert rc == 2 and "did you mean generate?" in err


def test_typo_in_benchmark_gets_a_suggestion(capsys):
    rc, err = run(["bench", "cots"], capsys)
    assert rc == 2 and "unknown benchmark 'cots' (did you mean cost?); allowed: decode, batch, cost, kernels, planner" in err


def test_no_command_prints_help(capsys):
    assert cli.main([]) == 2
    assert "generate" in capsys.readouterr().out


@pytest.mark.parametrize("content, needle", [
    ({"tree": {"depth": 3, "verifer": "ot"}}, "unknown option 'verifer'"),
    ({"depth": "3"}, "depth='3' must be an int"),
    ({"method": "fast"}, "method='fast' is not one of"),
    ([1, 2], "must hold one object"),
])
def test_invalid_config_file(tmp_path, content, needle, capsys):
    f = tmp_path / "cfg.json"
    f.write_text(json.dumps(content))
    rc, err = run(["generate", "--config", str(f)], capsys)
    assert rc == 2 and needle in err


def test_config_file_then_flags_override(tmp_path):
    f = tmp_path / "cfg.toml"
    f.write_text('depth = 3\nbudget = 6\n[sampling]\ntemperature = 0.5\n')
    args = cli.build_parser().parse_args(["generate", "--config", str(f), "--budget", "5"])
    tree = cli.tree_config_from(args)
    assert (tree.depth, tree.budget, args.temperature) == (3, 5, 0.5)
    assert tree.frontier == cli.DEFAULTS["frontier"]


def test_unparsable_config(tmp_path, capsys):
    f = tmp_path / "cfg.toml"
    f.write_text("depth = = 3")
    rc, err = run(["generate", "--config", str(f)], capsys)
    assert rc == 2 and "is not valid TOML" in err


def test_sampling_flags_and_config_file_make_the_sampling_config(tmp_path):
    from rheoplan import SamplingConfig

    f = tmp_path / "cfg.toml"
    f.write_text('[sampling]\nmin_p = 0.05\nrepetition_penalty = 1.2\n')
    args = cli.build_parser().parse_args(["generate", "--config", str(f), "--top-k", "40", "--typical-p", "0.9",
                                          "--repetition-penalty", "1.1"])
    assert cli.sampling_config_from(args) == SamplingConfig(top_k=40, min_p=0.05, typical_p=0.9,
                                                            repetition_penalty=1.1)


@pytest.mark.parametrize("argv, needle", [
    (["generate", "--budget", "many"], "argument --budget: invalid int_or_auto value: 'many'"),
    (["generate", "--calibration", "/no/such.json"], "--calibration=/no/such.json: no such file"),
    (["generate", "--budget", "8", "--depth", "4", "--calibration", "none"],
     "--calibration needs --depth auto or --budget auto"),
    (["generate", "--budget", "8", "--depth", "4", "--calibration", "x.json"],
     "--calibration needs --depth auto or --budget auto"),
    (["generate", "--budget", "8", "--depth", "4", "--save-calibration", "x.json"],
     "--save-calibration needs --depth auto or --budget auto"),
])
def test_auto_tree_options_fail_before_loading(argv, needle, capsys):
    try:
        rc, err = run(argv, capsys)
    except SystemExit as e:  # argparse's own type check
        rc, err = e.code, capsys.readouterr().err
    assert rc == 2 and needle in err


def test_auto_is_the_default_and_sizes_the_largest_tree():
    from rheoplan.loading import AUTO_BUDGET, AUTO_DEPTH

    args = cli.build_parser().parse_args(["generate"])
    tree = cli.tree_config_from(args)
    assert cli.uses_cost_model(args)
    assert tree.depth == AUTO_DEPTH and tree.budget == AUTO_BUDGET
    args = cli.build_parser().parse_args(["generate", "--depth", "2", "--slots", "2", "--frontier", "1"])
    tree = cli.tree_config_from(args)  # budget auto: at most what a depth-2 tree can hold
    assert cli.uses_cost_model(args) and (tree.depth, tree.budget) == (2, 4)
    args = cli.build_parser().parse_args(["generate", "--depth", "4", "--budget", "8"])
    assert not cli.uses_cost_model(args) and cli.tree_config_from(args).budget == 8


def test_config_file_takes_auto_for_depth_and_budget(tmp_path):
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"depth": "auto", "budget": 12}))
    assert cli.read_config_file(str(f)) == {"depth": "auto", "budget": 12}
    f.write_text(json.dumps({"budget": "lots"}))
    with pytest.raises(ValueError, match="budget='lots' must be an int"):
        cli.read_config_file(str(f))


# -- generate --prompts-file: many prompts, batched -----------------------------------------


@pytest.mark.parametrize("argv, needle", [
    (["generate", "hi", "--prompts-file", "{f}"], "both a prompt ('hi') and --prompts-file="),
    (["generate", "--batch-size", "4"], "--batch-size needs --prompts-file"),
    (["generate", "--output", "{d}/o.jsonl"], "--output needs --prompts-file"),
    (["generate", "--prompts-file", "{f}", "--batch-size", "0"], "--batch-size=0 is out of range: allowed >= 1"),
    (["generate", "--prompts-file", "{d}/none.txt"], "none.txt: no such file"),
    (["generate", "--prompts-file", "{empty}"], "holds no prompt"),
    (["generate", "--prompts-file", "{f}", "--backend", "triton"], "--backend=triton decodes a single sequence"),
    (["generate", "--prompts-file", "{f}", "--output", "{d}/no/dir/o.jsonl"], "does not exist"),
    (["generate", "--prompts-file", "{f}", "--output", "{f}"], "is the prompts file"),
])
def test_prompts_file_errors_before_loading(argv, needle, tmp_path, capsys):
    f, empty = tmp_path / "p.txt", tmp_path / "e.txt"
    f.write_text("one\ntwo\n")
    empty.write_text("")
    argv = [a.format(f=f, d=tmp_path, empty=empty) for a in argv]
    rc, err = run(argv, capsys)
    assert rc == 2 and needle in err


class _CharTokenizer:
    """Characters to ids of a 32-token vocabulary; no chat template, no EOS."""

    chat_template = None
    eos_token_id = None

    def __call__(self, text):
        return {"input_ids": [ord(c) % 32 for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) for i in ids)


@pytest.mark.parametrize("batch", [1, 2])
def test_prompts_file_rows_are_plan_and_decode_rows(batch, tmp_path, monkeypatch, capsys):
    """Each JSON line holds the tokens row i of ``plan_and_decode`` gives for the same
    prompts and seed (float32 models), whatever the batch size; per-line limits hold."""
    from _decode_models import tiny_llama

    target = tiny_llama(2, vocab=32, hidden=32, layers=2, head_scale=20.0)
    draft = tiny_llama(3, vocab=32, hidden=32, layers=1, head_scale=20.0)
    tok = _CharTokenizer()
    monkeypatch.setattr(cli, "load_default", lambda **k: (target, tok, draft))
    f = tmp_path / "p.jsonl"
    lines = [{"prompt": "abc"}, {"prompt": "hello there", "max_new_tokens": 3}, {"prompt": "xy\nz"}]
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    flags = ["--depth", "2", "--budget", "4", "--seed", "5", "-n", "6", "--no-chat"]
    out = tmp_path / "o.jsonl"
    rc = cli.main(["generate", "--prompts-file", str(f), "--batch-size", str(batch), "--output", str(out)] + flags)
    assert rc == 0
    assert "3 prompts, 15 new tokens" in capsys.readouterr().err
    recs = sorted((json.loads(x) for x in out.read_text().splitlines()), key=lambda r: r["index"])
    args = cli.build_parser().parse_args(["generate"] + flags)
    ref = plan_and_decode(target, draft, [tok(x["prompt"])["input_ids"] for x in lines], max_new_tokens=[6, 3, 6],
                          tree=cli.tree_config_from(args), sampling=cli.sampling_config_from(args), seed=5)
    assert [r["index"] for r in recs] == [0, 1, 2] and [r["line"] for r in recs] == [1, 2, 3]
    assert [r["tokens"] for r in recs] == [r.tokens for r in ref]
    assert [r["new_tokens"] for r in recs] == [6, 3, 6]
    assert recs[1]["text"] == tok.decode(ref[1].tokens) and recs[2]["prompt"] == "xy\nz"


@pytest.mark.parametrize("note_s, noted", [(3600.0, False), (-1.0, True)])
def test_generate_warms_up_with_the_runs_settings_and_prints_the_runs_own_tokens(note_s, noted, monkeypatch, capsys):
    """One prompt: an untimed warm-up decode (the run's sampling, tree and backend; the
    kernels compile there on a fresh install) runs before the decode, whose text is the
    one ``plan_and_decode`` gives alone; the warm-up is mentioned only when it was long."""
    from _decode_models import tiny_llama

    target = tiny_llama(2, vocab=32, hidden=32, layers=2, head_scale=20.0)
    draft = tiny_llama(3, vocab=32, hidden=32, layers=1, head_scale=20.0)
    tok = _CharTokenizer()
    monkeypatch.setattr(cli, "load_default", lambda **k: (target, tok, draft))
    monkeypatch.setattr(cli, "WARM_UP_NOTE_S", note_s)
    seen = []
    real = cli.warm_up
    monkeypatch.setattr(cli, "warm_up", lambda *a, **k: seen.append(k) or real(*a, **k))
    flags = ["--depth", "2", "--budget", "4", "--seed", "5", "-n", "6", "--no-chat", "--temperature", "0.7"]
    assert cli.main(["generate", "hello"] + flags) == 0
    out, err = capsys.readouterr()
    args = cli.build_parser().parse_args(["generate"] + flags)
    ref = plan_and_decode(target, draft, tok("hello")["input_ids"], max_new_tokens=6, seed=5,
                          tree=cli.tree_config_from(args), sampling=cli.sampling_config_from(args))
    assert out.strip() == tok.decode(ref.tokens)
    assert len(seen) == 1 and seen[0]["rows"] == 1 and seen[0]["sampling"].temperature == 0.7
    assert seen[0]["tree"] == cli.tree_config_from(args)
    assert ("warm-up: 8 tokens in" in err) == noted


def test_a_command_says_once_that_numba_compiles_and_nothing_when_nothing_compiles(monkeypatch, capsys):
    """The first numba compile of a command prints one line on stderr, later compiles of
    the same command none; a command that compiles nothing prints none; the listener is
    gone after the command."""
    def compile_two(args):  # two fresh functions: numba compiles both (no disk cache)
        njit(lambda x: x + 1)(1)
        njit(lambda x: x * 2.0)(1.5)
        return 0

    monkeypatch.setattr(cli, "cmd_generate", compile_two)
    assert cli.main(["generate", "hi"]) == 0
    err = capsys.readouterr().err
    assert err.count("numba: compiling kernels for this machine") == 1
    monkeypatch.setattr(cli, "cmd_generate", lambda args: 0)
    assert cli.main(["generate", "hi"]) == 0
    assert "numba" not in capsys.readouterr().err
    njit(lambda x: x - 1)(1)  # outside a command: nobody listens
    assert "numba" not in capsys.readouterr().err
