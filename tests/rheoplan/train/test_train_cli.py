"""``rheoplan train-draft``: argument checks, the model card, and the whole pipeline on a
tiny local model directory (``--target DIR``), killed and resumed."""

from __future__ import annotations

import json
import os

import pytest
import torch

from rheoplan.models.eagle3 import read_eagle3
from rheoplan.train import cli
from rheoplan.train import tokens as tk


def test_help_lists_the_main_flags(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--work-dir", "--tokens-dir", "--target", "--prompts", "--tokens-per-prompt", "--sample-dtype",
                 "--train-dtype", "--draft-vocab", "--epochs", "--resume", "--max-shards"):
        assert flag in out


@pytest.mark.parametrize("argv, msg", [
    (["--stages", "generate,fly"], "--stages"),
    (["--epochs", "0"], "--epochs"),
    (["--temperature", "-1"], "--temperature"),
    (["--prompts", "-3"], "--prompts"),
    (["--max-shards", "0"], "--max-shards"),
    (["--prompt-weight", "2"], "--prompt-weight"),
    (["--target", "/nonexistent/model"], "--target"),
    (["--heldout-prompts", "/nonexistent.txt"], "--heldout-prompts"),
    (["--draft-vocab", "0"], "--draft-vocab"),
    (["--init-from", "/nonexistent/head"], "--init-from"),
    (["--skip-rows", "-1"], "--skip-rows"),
    (["--tv-weight", "-1"], "--tv-weight"),
    (["--tv-weight", "nan"], "--tv-weight"),
    (["--ttt-steps", "0"], "--ttt-steps"),
    (["--step-decay", "0"], "--step-decay"),
    (["--step-decay", "1.5"], "allowed in \\(0, 1\\]"),
    (["--step-decay", "nan"], "--step-decay"),
    (["--step-decay", "1"], None),
    (["--more-prompts", "-128"], "--more-prompts"),
    (["--more-prompts", "100"], "allowed 0 or a positive multiple of 128"),
    (["--more-prompts", "64", "--batch-size", "16"], None),
    (["--shards", "/nonexistent.txt"], "--shards"),
    (["--exclude-shards", "/nonexistent.json"], "--exclude-shards"),
    (["--no-bf16", "--head-precision", "bf16"], "--no-bf16 with --head-precision bf16"),
    (["--no-bf16", "--head-precision", "fp32"], None),
])
def test_bad_arguments_are_rejected_before_any_work(argv, msg, tmp_path):
    a = cli.build_parser().parse_args(["--work-dir", str(tmp_path)] + argv)
    if msg is None:  # the edge of the allowed range
        cli._check_args(a)
        return
    with pytest.raises(SystemExit, match=msg):
        cli._check_args(a)


def test_more_prompts_leave_the_plan_as_it_is_and_extend_each_other(tmp_path):
    def plans(more):
        return cli.make_plan(cli.build_parser().parse_args(
            ["--work-dir", str(tmp_path), "--prompts", "40", "--more-prompts", str(more)]))

    plan0, none = plans(0)
    plan1, small = plans(128)
    plan2, large = plans(256)
    assert none == [] and plan0 == plan1 == plan2 and len(small) == 128 and large[:128] == small
    assert [p.id for p in small] == list(range(plan0[-1].id + 1, plan0[-1].id + 129))
    grows = cli.more_grows(large)
    assert grows(None) is None and grows(cli.more_record(small)) is None
    assert "allowed 256 or more" in cli.more_grows(small)(cli.more_record(large))
    assert "not the first" in grows({"prompts": 128, "digest": "0" * 16})


def test_shard_selection_reads_lists_and_run_records(tmp_path):
    listed = tmp_path / "shards.txt"
    listed.write_text("# the shards a head saw\ntrain_r1_00000\n\ntrain_fu_00000  # follow-ups\n")
    rec = tmp_path / "train_rows.json"
    rec.write_text(json.dumps({"shards": ["train_r1_00001"], "max_rows": None, "skip_rows": 0}))
    assert cli.read_shard_names(str(listed), "--shards") == ["train_r1_00000", "train_fu_00000"]
    names = ["train_fu_00000", "train_r1_00000", "train_r1_00001", "train_x_r1_00000"]

    def select(*argv):
        return cli._select_shards(cli.build_parser().parse_args(["--work-dir", str(tmp_path), *argv]), names)

    assert select() == names
    assert select("--shards", str(listed)) == ["train_fu_00000", "train_r1_00000"]
    assert select("--exclude-shards", str(listed)) == ["train_r1_00001", "train_x_r1_00000"]
    assert select("--exclude-shards", str(listed), "--shards", str(rec)) == ["train_r1_00001"]
    with pytest.raises(SystemExit, match="no training shards left"):
        select("--shards", str(rec), "--exclude-shards", str(rec))
    (tmp_path / "bad.txt").write_text("heldout_00000\n")
    with pytest.raises(SystemExit, match="expected training shard names"):
        cli.read_shard_names(str(tmp_path / "bad.txt"), "--shards")
    (tmp_path / "gone.txt").write_text("train_r1_00009\n")
    with pytest.raises(SystemExit, match="not in"):
        select("--shards", str(tmp_path / "gone.txt"))


def test_model_card_reads_sizes_from_the_report():
    ev = {"positions_step1": 100, "top1_step1": 0.5, "top3_step1": 0.7, "accept_lo_step1": 0.45,
          "accept_hi_step1": 0.5, "positions_step2": 90, "top1_step2": 0.4, "top3_step2": 0.6,
          "accept_lo_step2": 0.3, "accept_hi_step2": 0.35}
    card = cli.model_card({"eval_heldout_exported_fp16": ev, "argv": ["--work-dir", "w"],
                           "data": {"dataset": {"target": {"name": "mymodel.gguf", "num_hidden_layers": 32}}},
                           "export": {"params": 9.8e6, "safetensors_bytes": 19 * 2**20,
                                      "head_config": {"hidden_size": 4096, "target_hidden_size": 4096,
                                                      "num_attention_heads": 32, "num_key_value_heads": 8,
                                                      "intermediate_size": 14336, "hidden_act": "silu"}}})
    assert "| held-out (exported fp16 head) | 1 | 100 | 50.0% | 70.0% | 45.0%–50.0% |" in card
    assert "| held-out (exported fp16 head) | 2 | 90 | 40.0% | 60.0% | 30.0%–35.0% |" in card
    assert "H=4096, 32 heads / 8 kv heads" in card and "fc 12288 -> 4096" in card
    assert "layers [2, 16, 29]" in card and "mymodel.gguf" in card and "576" not in card
    assert "rheoplan train-draft --work-dir w" in card
    assert "total-variation" not in card  # cross-entropy alone
    tv = cli.model_card({"train": {"config": {"tv_weight": 32.0}}})
    assert "plus 32 x the total-variation term" in tv
    assert "appended by `--more-prompts`" not in card
    more = cli.model_card({"data": {"dataset": {"plan_prompts": 7804, "more": {"prompts": 8192, "digest": "x"}},
                                    "train": {"shards": 300, "exclude_shards_file": "old/train_shards.txt"}}})
    assert "7804 first turns (" in more and "8192 more appended by `--more-prompts`" in more
    assert "trained on 300 shards (not those listed in `old/train_shards.txt`)" in more


def _prompt_files(tmp_path):
    train, held = tmp_path / "train.txt", tmp_path / "held.txt"
    train.write_text("chat\tHello there!\ncode\tWrite a loop.\nsummarisation\tSummarise this: "
                     "The quick brown fox jumps over the lazy dog again and again, every single morning.\n")
    held.write_text("chat\tWhy does ice float on water?\nmath\tWhat is 35% of 180?\n")
    return ["--train-prompts", str(train), "--heldout-prompts", str(held)]


@pytest.mark.slow
def test_the_pipeline_runs_and_resumes_on_a_local_model(tiny_target_dir, tmp_path):
    work, toks = str(tmp_path / "work"), str(tmp_path / "tokens")
    base = ["--work-dir", work, "--tokens-dir", toks, "--target", tiny_target_dir, "--prompts", "40",
            "--tokens-per-prompt", "12", "--heldout-tokens", "6", "--batch-size", "8", "--threads", "1",
            "--no-progress", "--sample-dtype", "float32", "--train-dtype", "float32", "--draft-vocab", "40",
            "--chunk-tokens", "128", "--epochs", "2", "--no-bf16", "--ckpt-every", "2"] + _prompt_files(tmp_path)
    # generation killed after 3 shards, then resumed to the end
    assert cli.main(base + ["--stages", "generate", "--max-shards", "3"]) == 0
    assert len(tk.list_shards(toks, "train")) == 2 and len(tk.list_shards(toks, "heldout")) == 1
    assert cli.main(base + ["--stages", "generate"]) == 0
    st = tk.dataset_stats(toks)
    assert st["train_r1"]["rows"] == 43 and st["train_fu"]["rows"] >= 1
    assert json.load(open(os.path.join(toks, "dataset.json")))["target"]["vocab_size"] == 100
    # a directory of shards refuses other sampling settings
    with pytest.raises(SystemExit, match="other settings"):
        cli.main([x if x != "12" else "13" for x in base] + ["--stages", "generate"])
    # the plan grown by 32 prompts: shards of their own, the record grows with it, and a
    # smaller extension is refused before any sampling
    assert cli.main(base + ["--stages", "generate", "--more-prompts", "32"]) == 0
    st = tk.dataset_stats(toks)
    assert st["train_x_r1"]["rows"] == 32 and st["train_x_fu"]["shards"] == 1 and st["train_r1"]["rows"] == 43
    assert json.load(open(os.path.join(toks, "dataset.json")))["more"]["prompts"] == 32
    with pytest.raises(SystemExit, match="allowed 32 or more"):
        cli.main(base + ["--stages", "generate"])
    # training stopped after 3 steps, resumed to 5 (with the shard selection it began with)
    assert cli.main(base + ["--stages", "train", "--max-steps", "3"]) == 0
    assert torch.load(os.path.join(work, "ckpt.pt"), weights_only=False)["step"] == 3
    assert "train_x_r1_00000" in json.load(open(os.path.join(work, "train_rows.json")))["shards"]
    seen = tmp_path / "seen.txt"
    seen.write_text("train_x_r1_00000\n")
    with pytest.raises(SystemExit, match="--exclude-shards"):
        cli.main(base + ["--stages", "train", "--resume", "--exclude-shards", str(seen)])
    assert cli.main(base + ["--stages", "train,export", "--resume", "--max-steps", "5"]) == 0
    rep = json.load(open(os.path.join(work, "export", "report.json")))
    assert rep["train"]["started_at_step"] == 3 and rep["train"]["steps_done"] == 5
    ev = rep["eval_heldout_exported_fp16"]
    assert ev["positions_step1"] > 0 and 0 <= ev["top1_step1"] <= ev["top3_step1"] <= 1 and "top1_step3" in ev
    card = open(os.path.join(work, "export", "MODEL_CARD.md")).read()
    assert "H=32, 4 heads / 2 kv heads" in card and "| held-out (exported fp16 head) | 3 |" in card
    # a resumed run still reports its vocabulary coverage and the time of both sittings
    assert 0 < rep["draft_vocab_train_coverage"] <= 1 and "covering n/a" not in card
    assert "over all sittings (the last, resumed at step 3" in card
    assert read_eagle3(os.path.join(work, "export")).config.draft_vocab_size == 40


@pytest.mark.slow
def test_init_from_continues_an_exported_head(tiny_target_dir, tmp_path):
    """``--init-from``: the exported head (scale folded into fc) is unfolded again, so the
    run starts from exactly that head: its held-out numbers before training equal the
    export's; a larger ``--draft-vocab`` grows its vocabulary; a head that does not fit (a
    smaller vocabulary, another target) is refused before training."""
    toks = str(tmp_path / "tokens")
    base = ["--tokens-dir", toks, "--target", tiny_target_dir, "--prompts", "16", "--tokens-per-prompt", "10",
            "--heldout-tokens", "6", "--batch-size", "8", "--threads", "1", "--no-progress",
            "--sample-dtype", "float32", "--train-dtype", "float32", "--chunk-tokens", "128", "--epochs", "1",
            "--no-bf16"] + _prompt_files(tmp_path)
    first = str(tmp_path / "first")
    assert cli.main(base + ["--work-dir", first, "--draft-vocab", "40", "--max-steps", "2"]) == 0
    exported = os.path.join(first, "export")
    first_rep = json.load(open(os.path.join(exported, "report.json")))
    before = first_rep["eval_heldout_exported_fp16"]

    second = str(tmp_path / "second")
    with pytest.raises(SystemExit, match="--draft-vocab=30 .* allowed 40"):
        cli.main(base + ["--work-dir", second, "--stages", "train", "--init-from", exported, "--draft-vocab", "30"])
    # a larger --draft-vocab grows the head's vocabulary (rheoplan.train.train.extend_vocab)
    # (and, without --no-bf16, trains in the precision measured faster here)
    grown = str(tmp_path / "grown")
    assert cli.main([x for x in base if x != "--no-bf16"] + [
        "--work-dir", grown, "--stages", "train,export", "--init-from", exported, "--draft-vocab", "50",
        "--max-steps", "1"]) == 0
    chosen = json.load(open(os.path.join(grown, "export", "report.json")))["train"]["head_precision"]
    assert chosen["asked"] == "auto" and chosen["precision"] in ("bf16", "fp32") and set(chosen["step_s"]) == {"bf16", "fp32"}
    assert "(the faster here, measured)" in open(os.path.join(grown, "export", "MODEL_CARD.md")).read()
    g = read_eagle3(os.path.join(grown, "export"))
    assert g.config.draft_vocab_size == 50
    assert set(read_eagle3(exported).target_ids().tolist()) < set(g.target_ids().tolist())
    assert "draft vocabulary grown from 40 tokens" in open(os.path.join(grown, "export", "MODEL_CARD.md")).read()
    assert cli.main(base + ["--work-dir", second, "--stages", "train,export", "--init-from", exported,
                            "--lr", "3e-4", "--max-steps", "2", "--skip-rows", "5"]) == 0
    rep = json.load(open(os.path.join(second, "export", "report.json")))
    # --skip-rows: the rows after the first 5
    assert rep["data"]["train"]["skipped_rows"] == 5
    assert rep["data"]["train"]["rows"] == first_rep["data"]["train"]["rows"] - 5
    init = rep["eval_heldout_init"]
    for k in ("top1_step1", "top3_step1", "top1_step2"):
        assert init[k] == pytest.approx(before[k], abs=0.02)
    assert init["loss_step1"] == pytest.approx(before["loss_step1"], rel=1e-2)
    assert torch.equal(read_eagle3(os.path.join(second, "export")).target_ids(), read_eagle3(exported).target_ids())
    card = open(os.path.join(second, "export", "MODEL_CARD.md")).read()
    assert "after their first 5 rows (`--skip-rows`)" in card
    assert "(`--init-from`)" in card and "| held-out, the --init-from head before this run | 1 |" in card

    # a head made for another target (hidden size 48, not 32) is refused, naming what differs
    from rheoplan.models.eagle3 import Eagle3Config, Eagle3Head, save_eagle3
    other = Eagle3Head(Eagle3Config(vocab_size=100, draft_vocab_size=40, hidden_size=48, intermediate_size=64,
                                    num_attention_heads=4, num_key_value_heads=2))
    other.set_vocab_map(torch.arange(40))
    save_eagle3(other, str(tmp_path / "other"))
    with pytest.raises(SystemExit, match="not made for this target: hidden_size"):
        cli.main(base + ["--work-dir", str(tmp_path / "third"), "--stages", "train",
                         "--init-from", str(tmp_path / "other")])
