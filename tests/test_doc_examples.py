"""Every ```python block in README.md and docs/*.md runs.

The blocks of one file run in order in one namespace (a later block may use names an
earlier one defined). A block that needs the real SmolLM2 model says so on the line
before its fence::

    <!-- example: realmodel -->

Those blocks run in the real-model group (``-m realmodel``), in a namespace of their own
per file, with ``load_smollm2`` loading the model once for the whole group. A block
tagged ``gpu`` (``<!-- example: realmodel gpu -->``) runs where CUDA is available and is
skipped, saying so, elsewhere. Nothing else is skipped: a block that is not meant to run
must not be fenced as ``python``.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from _package import ROOT
from rheoplan.models import smollm

TAG = re.compile(r"^<!-- example:((?: (?:realmodel|gpu))+) -->$")
FENCE = re.compile(r"^```python\s*$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  #: 1-based line of the first code line
    code: str
    tags: frozenset[str]  #: from the tag line before the fence: "realmodel", "gpu"

    @property
    def realmodel(self) -> bool:
        return "realmodel" in self.tags


def blocks(path: Path) -> list[Block]:
    """The ```python blocks of a markdown file, in order."""
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        if FENCE.match(lines[i]):
            before = [ln for ln in lines[:i] if ln.strip()]
            tag = TAG.match(before[-1].strip()) if before else None
            tags = frozenset(tag.group(1).split()) if tag else frozenset()
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            if j == len(lines):
                raise ValueError(f"{path}:{i + 1}: ```python block is never closed")
            out.append(Block(path, i + 2, "\n".join(lines[i + 1:j]) + "\n", tags))
            i = j
        i += 1
    return out


def run_blocks(bs: list[Block]) -> dict:
    """Run ``bs`` in order in one namespace; a failure names the file and line."""
    ns: dict = {"__name__": "__doc_example__"}
    for b in bs:
        # Pad with newlines so tracebacks show the markdown file's own line numbers.
        code = compile("\n" * (b.line - 1) + b.code, str(b.path), "exec")
        exec(code, ns)
    return ns


DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


def _cases():
    out = []
    for path in DOCS:
        bs = blocks(path)
        rel = path.relative_to(ROOT)
        for tags in sorted({b.tags for b in bs}, key=sorted):
            mine = [b for b in bs if b.tags == tags]
            marks = [pytest.mark.realmodel, pytest.mark.slow] if "realmodel" in tags else []
            if "gpu" in tags:
                marks.append(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))
            out.append(pytest.param(mine, id="-".join([str(rel)] + sorted(tags)), marks=marks))
    return out


_LOAD = smollm.load_smollm2  # the real loader, kept before any patching


@functools.lru_cache(maxsize=None)
def _load_once(dtype):
    return _LOAD(dtype=dtype)


@pytest.fixture
def smollm_loaded_once(monkeypatch):
    """``load_smollm2`` returns one shared (model, tokenizer) per dtype: the blocks only
    read the model, and loading it takes ~16 s."""
    monkeypatch.setattr(smollm, "load_smollm2", lambda dtype=torch.float32: _load_once(dtype))


@pytest.mark.parametrize("bs", _cases())
def test_doc_example(bs, request, monkeypatch):
    if bs[0].realmodel:
        request.getfixturevalue("smollm_loaded_once")
        request.getfixturevalue("one_torch_thread")  # much faster on a small shared machine
    monkeypatch.chdir(ROOT)
    run_blocks(bs)


def test_the_collector_finds_every_block():
    found = {p.relative_to(ROOT).as_posix(): len(blocks(p)) for p in DOCS}
    assert found["README.md"] >= 1 and found["docs/quickstart.md"] >= 2
    text_count = sum(1 for p in DOCS for ln in p.read_text().splitlines() if ln.startswith("```python"))
    assert sum(found.values()) == text_count


def test_a_failing_block_fails_and_names_its_line(tmp_path):
    md = tmp_path / "x.md"
    md.write_text("intro\n\n```python\nx = 1\n```\n\n<!-- example: realmodel -->\n```python\n"
                  "y = x + 1\nassert y == 3\n```\n")
    bs = blocks(md)
    assert [(b.line, b.tags) for b in bs] == [(4, frozenset()), (9, frozenset({"realmodel"}))]
    with pytest.raises(AssertionError) as e:
        run_blocks(bs)
    assert any(f.lineno + 1 == 10 and str(f.path) == str(md) for f in e.traceback)  # lineno is 0-based
