"""Self-distillation inputs: the target loader and the shipped prompt files."""

from __future__ import annotations

import os

import pytest

from rheoplan.train import selfdistill as sd


def test_load_target_reads_a_local_model_directory(tiny_target_dir):
    model, tok, name = sd.load_target(tiny_target_dir)
    assert model.config.num_hidden_layers == 4 and not model.training
    assert sd.eos_id(model, tok) == 2 and name == os.path.basename(tiny_target_dir)
    rec = sd.target_record(model, name)
    assert (rec["vocab_size"], rec["hidden_size"], rec["num_hidden_layers"]) == (100, 32, 4)


def test_load_target_rejects_a_directory_without_a_model(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        sd.load_target(str(tmp_path))


def test_shipped_prompt_files():
    train = sd.read_prompts(sd.data_file("prompts_train.txt"))
    held = sd.read_prompts(sd.data_file("prompts_heldout.txt"))
    assert len(train) >= 300 and len(held) >= 40
    assert not {p for _, p in train} & {p for _, p in held}
    assert len({p for _, p in train}) == len(train)
    assert {c for c, _ in held} == {"chat", "code", "math", "summarisation"}
    assert {"chat", "code", "math", "summarisation", "instructions"} <= {c for c, _ in train}


def test_read_prompts_rejects_lines_without_a_category(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("# comment\nchat\tfine\nno tab here\n")
    with pytest.raises(ValueError, match="category<TAB>prompt"):
        sd.read_prompts(f)
