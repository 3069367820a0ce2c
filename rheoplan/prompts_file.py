"""Prompts files for ``rheoplan generate --prompts-file``: read and checked before any model
work, and the JSON line written for each prompt as it finishes.

Two formats, chosen by the file name:

* plain text: one prompt per line (a last line without a newline is fine);
* ``*.jsonl``: one JSON object per line, ``{"prompt": "...", "max_new_tokens": 32}``
  (``max_new_tokens`` optional: the command's ``--max-new-tokens`` otherwise). JSON lets
  a prompt hold newlines.

Nothing is skipped silently: an empty line, a line that is not a JSON object, a key other
than those two, a limit below 1 or a file without a prompt is an error naming the file and
the line.

    >>> import io
    >>> [(p.text, p.max_new_tokens) for p in parse_prompts(io.StringIO('{"prompt": "hi", "max_new_tokens": 3}\\n'),
    ...                                                      "p.jsonl")]
    [('hi', 3)]
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO

#: the keys a ``.jsonl`` line may hold
JSONL_KEYS = ("prompt", "max_new_tokens")


@dataclass(frozen=True)
class PromptLine:
    """One prompt of a prompts file: its text, its own limit (None: the command's) and the
    line it came from (1-based)."""

    text: str
    max_new_tokens: int | None
    line: int


def is_jsonl(name: str) -> bool:
    """Whether ``name`` (a path, or ``-`` for stdin) is read as JSON lines."""
    return name.endswith(".jsonl")


def read_prompts(name: str) -> list[PromptLine]:
    """The prompts of the file ``name`` (``-``: stdin, read as plain text)."""
    if name == "-":
        return parse_prompts(sys.stdin, "-")
    path = Path(name)
    if not path.is_file():
        raise ValueError(f"--prompts-file={name}: no such file")
    with path.open(encoding="utf-8") as f:
        return parse_prompts(f, name)


def parse_prompts(stream: IO[str], name: str) -> list[PromptLine]:
    """The prompts in ``stream``, in the format ``name`` implies (``is_jsonl``)."""
    jsonl = is_jsonl(name)
    out = []
    for i, raw in enumerate(stream, start=1):
        line = raw.rstrip("\n").rstrip("\r")
        where = f"--prompts-file={name} line {i}"
        if not line.strip():
            raise ValueError(f"{where} is empty: allowed one prompt per line")
        out.append(_json_line(line, where, i) if jsonl else PromptLine(line, None, i))
    if not out:
        raise ValueError(f"--prompts-file={name} holds no prompt: allowed one prompt per line")
    return out


def _json_line(line: str, where: str, i: int) -> PromptLine:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where} is not JSON ({e.msg}): allowed one object per line, "
                         '{"prompt": "...", "max_new_tokens": N}') from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where} is a JSON {type(obj).__name__}: allowed an object with a \"prompt\" string")
    extra = sorted(set(obj) - set(JSONL_KEYS))
    if extra:
        raise ValueError(f"{where} has unknown keys {extra}: allowed {list(JSONL_KEYS)}")
    text = obj.get("prompt")
    if not isinstance(text, str) or not text:
        raise ValueError(f"{where}: \"prompt\" must be a non-empty string, got {text!r}")
    limit = obj.get("max_new_tokens")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"{where}: max_new_tokens={limit!r} is out of range: allowed an int >= 1")
    return PromptLine(text, limit, i)


def result_record(index: int, prompt: PromptLine, text: str, result) -> dict:
    """The JSON line of a finished prompt: where it came from, its text and token ids, why it
    stopped and how the decode went (a ``DecodeResult``): seconds from the start of the run
    until it joined the batch, until its first token and until it finished."""
    steps = result.steps
    first = result.first_token_seconds
    return {"index": index, "line": prompt.line, "prompt": prompt.text, "text": text,
            "tokens": list(result.tokens), "new_tokens": len(result.tokens), "stopped_by": result.stopped_by,
            "steps": len(steps), "mean_accepted_length": round(result.mean_accepted_length, 4),
            "joined_seconds": round(result.joined_seconds, 4),
            "first_token_seconds": None if first is None else round(first, 4),
            "seconds": round(result.seconds, 4)}
