"""``rheoplan train-draft`` argument handling and the model card (no model loading)."""

from __future__ import annotations

import pytest

from rheoplan.train import cli


def test_help_lists_the_main_flags(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--work-dir", "--out", "--num-prompts", "--tokens-per-prompt", "--temperatures",
                 "--draft-vocab", "--epochs", "--resume"):
        assert flag in out


@pytest.mark.parametrize("argv, msg", [
    (["--stages", "sample,fly"], "--stages"),
    (["--epochs", "0"], "--epochs"),
    (["--temperatures", "0,-1"], "--temperatures"),
])
def test_bad_arguments_are_rejected_before_any_work(argv, msg, tmp_path):
    a = cli.build_parser().parse_args(["--work-dir", str(tmp_path)] + argv)
    with pytest.raises(SystemExit, match=msg):
        cli._check_args(a)
        cli._sampling_manifest(a)


def test_work_dir_refuses_other_sampling_settings(tmp_path):
    a = cli.build_parser().parse_args(["--work-dir", str(tmp_path)])
    cli._check_manifest(str(tmp_path), cli._sampling_manifest(a))
    cli._check_manifest(str(tmp_path), cli._sampling_manifest(a))  # same settings: fine
    b = cli.build_parser().parse_args(["--work-dir", str(tmp_path), "--tokens-per-prompt", "7"])
    with pytest.raises(SystemExit, match="other settings"):
        cli._check_manifest(str(tmp_path), cli._sampling_manifest(b))


def test_model_card_reports_measured_numbers():
    ev = {"positions_step1": 100, "top1_step1": 0.5, "top1_step2": 0.4, "accept_lo_step1": 0.45,
          "accept_hi_step1": 0.5, "accept_lo_step2": 0.3, "accept_hi_step2": 0.35}
    head = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
            "target_hidden_size": 48}
    card = cli.model_card({"eval_heldout_exported_fp16": ev, "argv": ["--work-dir", "w"],
                           "export": {"params": 9.8e6, "safetensors_bytes": 19 * 2**20, "head_config": head,
                                      "target": {"layers": 10}}})
    assert "layers 2, 5, 7 of `model`" in card  # read from the report, not SmolLM2's sizes
    assert "one decoder layer (H=64, 4 heads / 2 kv heads, SwiGLU 96), fc 144 -> 64" in card
    assert "| held-out (exported fp16 head) | 100 | 50.0% | 40.0% | 45.0%–50.0% | 30.0%–35.0% |" in card
    assert "rheoplan train-draft --work-dir w" in card
