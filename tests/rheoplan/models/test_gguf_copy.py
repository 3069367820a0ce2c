"""The converted copy of a GGUF model (``rheoplan.models.gguf_copy``): later loads get the
same model bit for bit, a changed file or library converts again, a damaged copy is made
again, and the switch is checked. A tiny random Llama stands in for the GGUF's model; one
real-model test compares SmolLM2 read both ways."""

from __future__ import annotations

import os

import pytest
import torch

from _adapter_models import tiny_llama
from rheoplan.models import gguf_copy
from rheoplan.testing import mutation


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<eos>", "the", "sea", "is", "blue"]
    t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", eos_token="<eos>")


@pytest.fixture
def source(tmp_path, monkeypatch):
    """A stand-in GGUF file, an empty cache dir, and a loader that counts its calls."""
    monkeypatch.setenv("RHEOPLAN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(gguf_copy.ENV, raising=False)
    gguf = tmp_path / "pkg" / "tiny.Q4_1.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF stand-in")
    calls = []

    def load():
        calls.append(1)
        return tiny_llama(seed=3), _tokenizer()

    return gguf, load, calls


def _same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_second_load_reads_the_copy_bit_for_bit(source):
    gguf, load, calls = source
    m0, t0 = load()
    calls.clear()
    m1, t1 = gguf_copy.cached_load(gguf, load)  # converts, writes the copy and reads it back
    assert len(calls) == 1 and (gguf_copy.copy_dir(gguf) / gguf_copy.SOURCE_FILE).is_file()
    assert _same_weights(m0, m1)
    m2, t2 = gguf_copy.cached_load(gguf, load)
    assert len(calls) == 1  # read from the copy, not converted again
    assert _same_weights(m1, m2)
    assert next(m2.parameters()).dtype == torch.float32 and not m2.training
    assert m2.config._name_or_path == str(gguf.parent)  # what the latency caches key on
    assert t2("the sea is blue")["input_ids"] == t1("the sea is blue")["input_ids"]
    assert t2.eos_token_id == t1.eos_token_id
    ids = torch.tensor([[2, 3, 4, 5, 1]])
    with torch.no_grad():
        assert torch.equal(m1(ids).logits, m2(ids).logits)


def test_a_lossy_copy_is_caught(source):
    """The control: a copy stored through bfloat16 (``model_copy_bf16``) is another model."""
    gguf, load, _ = source
    with mutation("model_copy_bf16"):
        written, _ = gguf_copy.cached_load(gguf, load)
    again, _ = gguf_copy.cached_load(gguf, load)
    direct, _ = load()
    assert _same_weights(written, again)  # both read the copy
    assert not _same_weights(again, direct)


def test_changed_file_or_library_converts_again_and_drops_the_old_copy(source, monkeypatch):
    gguf, load, calls = source
    gguf_copy.cached_load(gguf, load)
    first = gguf_copy.copy_dir(gguf)
    st = gguf.stat()
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a reinstall
    second = gguf_copy.copy_dir(gguf)
    assert second != first
    gguf_copy.cached_load(gguf, load)
    assert len(calls) == 2 and second.is_dir() and not first.exists()
    real = gguf_copy._package_version
    monkeypatch.setattr(gguf_copy, "_package_version", lambda name: "9.9" if name == "gguf" else real(name))
    assert gguf_copy.copy_dir(gguf) != second  # another dequantiser, another copy


def test_damaged_copy_is_reported_and_made_again(source, capsys):
    gguf, load, calls = source
    gguf_copy.cached_load(gguf, load)
    weights = gguf_copy.copy_dir(gguf) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    m, _ = gguf_copy.cached_load(gguf, load)
    assert len(calls) == 2 and "could not read" in capsys.readouterr().err
    again, _ = gguf_copy.cached_load(gguf, load)
    assert len(calls) == 2 and _same_weights(m, again)


def test_unfinished_folder_is_replaced(source):
    """A folder under the copy's name without its source file (not a finished copy)."""
    gguf, load, calls = source
    folder = gguf_copy.copy_dir(gguf)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    gguf_copy.cached_load(gguf, load)
    gguf_copy.cached_load(gguf, load)
    assert len(calls) == 1 and (folder / gguf_copy.SOURCE_FILE).is_file()


def test_switched_off_reads_the_gguf_and_writes_nothing(source, monkeypatch):
    gguf, load, calls = source
    monkeypatch.setenv(gguf_copy.ENV, "0")
    gguf_copy.cached_load(gguf, load)
    gguf_copy.cached_load(gguf, load)
    assert len(calls) == 2 and not gguf_copy.copy_dir(gguf).parent.exists()
    monkeypatch.setenv(gguf_copy.ENV, "1")
    gguf_copy.cached_load(gguf, load, use_copy=False)
    assert len(calls) == 3 and not gguf_copy.copy_dir(gguf).parent.exists()


def test_bad_switch_value_names_the_variable(source, monkeypatch):
    gguf, load, calls = source
    monkeypatch.setenv(gguf_copy.ENV, "yes")
    with pytest.raises(ValueError, match=r"RHEOPLAN_MODEL_CACHE='yes' is not understood: allowed '0' .* or '1'"):
        gguf_copy.cached_load(gguf, load)
    assert not calls  # before any work


def test_too_little_disk_writes_nothing(source, monkeypatch, capsys):
    gguf, load, calls = source

    class Usage:
        free = 1000

    monkeypatch.setattr(gguf_copy.shutil, "disk_usage", lambda path: Usage())
    m, _ = gguf_copy.cached_load(gguf, load)
    assert "not written" in capsys.readouterr().err
    assert not gguf_copy.copy_dir(gguf).exists()
    gguf_copy.cached_load(gguf, load)
    assert len(calls) == 2


def test_unwritable_cache_still_loads(source, monkeypatch, capsys):
    gguf, load, calls = source

    def fail(*a, **k):
        raise PermissionError("read-only file system")

    monkeypatch.setattr("safetensors.torch.save_model", fail)
    m, _ = gguf_copy.cached_load(gguf, load)
    assert "not written (PermissionError: read-only file system)" in capsys.readouterr().err
    assert not gguf_copy.copy_dir(gguf).exists() and not list(gguf_copy.copy_dir(gguf).parent.iterdir())
    assert isinstance(m, torch.nn.Module) and len(calls) == 1


@pytest.mark.realmodel
def test_smollm2_copy_equals_the_gguf():
    """SmolLM2 read from its converted copy (written now if missing) and from the GGUF:
    the same weights, configs and token ids."""
    from rheoplan.loading import encode_prompt
    from rheoplan.models import smollm

    try:
        copied, tok_c = smollm.load_smollm2()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    read, tok_g = smollm.load_smollm2(use_copy=False)
    assert "quantization_config" not in copied.config.to_dict()  # read from the copy, even when just written
    assert _same_weights(copied, read)
    assert copied.lm_head.weight.data_ptr() == copied.model.embed_tokens.weight.data_ptr()  # still tied
    ca, cb = copied.config.to_dict(), read.config.to_dict()
    cb.pop("quantization_config", None)
    assert ca == cb
    assert copied.generation_config.to_dict() == read.generation_config.to_dict()
    for text in ["Write a short poem about the sea.", "Ünïcödé 東京 🙂\ttabs\nand <|im_end|> markers", ""]:
        assert encode_prompt(tok_c, text, chat=True) == encode_prompt(tok_g, text, chat=True)
        assert tok_c(text)["input_ids"] == tok_g(text)["input_ids"]
    assert (tok_c.eos_token_id, tok_c.pad_token_id, tok_c.all_special_ids) == \
        (tok_g.eos_token_id, tok_g.pad_token_id, tok_g.all_special_ids)
