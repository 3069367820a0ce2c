"""A converted copy of a GGUF model: dequantise it once, then load it in about a second.

transformers reads a GGUF file through ``from_pretrained(..., gguf_file=...)``, and every
load parses it again: the tokenizer, the config and the weights each read the file's
metadata (SmolLM2's 49,152-token vocabulary and merges), and the weights' name map is
rebuilt once per tensor. For SmolLM2-135M that is 16-22 s on the 2-core CPU, every time,
in front of a decode of 1.3-2.0 s for 64 tokens (cProfile of the load: docs/cli.md,
"Loading the model").

``cached_load`` keeps what the first load produced under
``cache_dir()/models/<file stem>-<key>/``: the dequantised weights in float32 safetensors
(float32 is what the GGUF is dequantised to, so they are the same tensors bit for bit),
the config, the generation config and the tokenizer; later loads read that folder
(``from_pretrained`` on a plain model directory). The model's ``_name_or_path`` is set
back to the GGUF's folder, so the latency caches (``rheoplan.probe.model_identity``) see
the same model either way.

The key covers the GGUF file (its resolved path, size and modification time) and the
versions of transformers and gguf that dequantised it: a reinstall or an upgrade converts
again, and the copies of the same file under older keys are removed then.
``RHEOPLAN_MODEL_CACHE=0`` turns the copy off (read the GGUF every time, write nothing).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Callable

import torch

from rheoplan.costmodel import cache_dir
from rheoplan.mutation import active

#: the environment variable that turns the copy off ("0") or on ("1", the default)
ENV = "RHEOPLAN_MODEL_CACHE"
#: written last into a copy's folder: a folder without it is not a finished copy
SOURCE_FILE = "rheoplan_source.json"
#: bump when what a copy holds changes, so older copies are converted again
FORMAT = 1


def copy_enabled() -> bool:
    """Whether loads keep and read a converted copy (``RHEOPLAN_MODEL_CACHE``: unset or
    ``'1'``: yes, ``'0'``: no); any other value is an error that names the variable."""
    value = os.environ.get(ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV}={value!r} is not understood: allowed '0' (read the GGUF every time) "
                         "or '1' (keep a converted copy, the default)")
    return value == "1"


def _package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "none"


def copy_key(gguf: Path) -> str:
    """What a copy of ``gguf`` is valid for: the file (resolved path, size, modification
    time) and the dequantising versions of transformers and gguf, hashed (16 hex digits)."""
    st = gguf.stat()
    text = json.dumps({"file": str(gguf.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                       "transformers": _package_version("transformers"), "gguf": _package_version("gguf"),
                       "format": FORMAT}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def copy_dir(gguf: Path) -> Path:
    """The folder a copy of ``gguf`` lives in: ``cache_dir()/models/<stem>-<copy_key>``."""
    return cache_dir() / "models" / f"{gguf.stem}-{copy_key(gguf)}"


def _note(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def read_copy(folder: Path, name_or_path: str):
    """``(model, tokenizer)`` from a finished copy in ``folder`` (float32, eval mode), with
    ``config._name_or_path = name_or_path``; None when there is no finished copy there."""
    if not (folder / SOURCE_FILE).is_file():
        return None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
    model.config._name_or_path = name_or_path
    return model.eval(), tok


def _weights_bytes(model: torch.nn.Module) -> int:
    seen, n = set(), 0
    for p in model.state_dict().values():
        if p.data_ptr() not in seen:  # tied weights are stored once
            seen.add(p.data_ptr())
            n += p.numel() * p.element_size()
    return n


def write_copy(model: torch.nn.Module, tok, folder: Path, source: dict) -> bool:
    """Write ``model`` (float32) and ``tok`` as a plain transformers folder at ``folder``,
    atomically (a temporary folder beside it, renamed when complete), and remove the copies
    of the same file under other keys. Returns False, writing nothing, when the disk holds
    less than twice the weights' size."""
    from safetensors.torch import save_model

    parent = folder.parent
    parent.mkdir(parents=True, exist_ok=True)
    need = _weights_bytes(model)
    free = shutil.disk_usage(parent).free
    if free < 2 * need:
        _note(f"model copy: not written ({free / 2**20:.0f} MiB free in {parent}, {need / 2**20:.0f} MiB "
              "needed): the next load reads the GGUF again")
        return False
    tmp = parent / f".{folder.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        cfg = copy.deepcopy(model.config)
        if hasattr(cfg, "quantization_config"):  # the copy holds plain float32 weights
            del cfg.quantization_config
        cfg.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        if active("model_copy_bf16"):  # test-only: a lossy copy (rheoplan.mutation)
            save_model(copy.deepcopy(model).to(torch.bfloat16).to(torch.float32), str(tmp / "model.safetensors"))
        else:
            save_model(model, str(tmp / "model.safetensors"))
        tok.save_pretrained(tmp)
        (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=1, sort_keys=True) + "\n")
        if folder.is_dir() and not (folder / SOURCE_FILE).is_file():
            shutil.rmtree(folder, ignore_errors=True)  # not a finished copy (e.g. emptied by hand)
        try:
            os.replace(tmp, folder)
        except OSError:  # another process finished the same copy first: keep that one
            if not (folder / SOURCE_FILE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    stem = folder.name.rsplit("-", 1)[0]
    for old in parent.glob(f"{stem}-*"):
        if old != folder and old.is_dir() and (old / SOURCE_FILE).is_file():
            shutil.rmtree(old, ignore_errors=True)  # the same file under an older key
    return True


def cached_load(gguf: Path, load_gguf: Callable[[], tuple], *, use_copy: bool | None = None):
    """``(model, tokenizer)`` of the GGUF file ``gguf``: from its converted copy when there
    is one, else ``load_gguf()`` (which dequantises it to float32), then a copy is written
    and read back.
    ``use_copy``: None follows ``RHEOPLAN_MODEL_CACHE``; False reads the GGUF and writes
    nothing. A copy that fails to load is reported, removed and made again."""
    gguf = Path(gguf)
    if not (copy_enabled() if use_copy is None else use_copy):
        return load_gguf()
    folder = copy_dir(gguf)
    try:
        got = read_copy(folder, str(gguf.parent))
    except Exception as e:  # a damaged copy: the GGUF is the source of truth
        _note(f"model copy: could not read {folder} ({type(e).__name__}: {e}); reading the GGUF again")
        shutil.rmtree(folder, ignore_errors=True)
        got = None
    if got is not None:
        return got
    t0 = time.perf_counter()
    model, tok = load_gguf()
    t_gguf = time.perf_counter() - t0
    source = {"gguf": str(gguf.resolve()), "key": copy_key(gguf), "format": FORMAT,
              "transformers": _package_version("transformers"), "gguf_package": _package_version("gguf")}
    try:
        written = write_copy(model, tok, folder, source)
    except OSError as e:  # a read-only or full cache dir: the load itself has succeeded
        _note(f"model copy: not written ({type(e).__name__}: {e}): the next load reads the GGUF again")
        written = False
    if not written:
        return model, tok
    _note(f"model copy: the GGUF took {t_gguf:.1f} s to read; its float32 weights, configs and tokenizer "
          f"are now in {folder} ({_weights_bytes(model) / 2**20:.0f} MiB), which later loads read "
          f"instead ({ENV}=0: off)")
    # read it back (~0.4 s): every load with the copy on then returns the same kind of
    # model (no GGUF quantizer state attached), and a copy that does not load is caught now
    try:
        return read_copy(folder, str(gguf.parent))
    except Exception as e:
        _note(f"model copy: the new copy in {folder} does not load ({type(e).__name__}: {e}); removed")
        shutil.rmtree(folder, ignore_errors=True)
        return model, tok
