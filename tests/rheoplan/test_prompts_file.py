"""Prompts files (``rheoplan.prompts_file``): both formats, and every malformed line is an
error naming the file and the line, never skipped."""

from __future__ import annotations

import io

import pytest

from rheoplan.prompts_file import parse_prompts, read_prompts, result_record
from rheoplan.decode import DecodeResult, StepStats


def parse(text: str, name: str = "p.txt"):
    return parse_prompts(io.StringIO(text), name)


def test_plain_text_one_prompt_per_line_last_newline_optional():
    got = parse("first prompt\nsecond, with: punctuation\r\nthird")
    assert [(p.text, p.max_new_tokens, p.line) for p in got] == [
        ("first prompt", None, 1), ("second, with: punctuation", None, 2), ("third", None, 3)]


def test_jsonl_holds_newlines_and_own_limits():
    got = parse('{"prompt": "a\\nb", "max_new_tokens": 5}\n{"prompt": "c"}\n', "x.jsonl")
    assert [(p.text, p.max_new_tokens, p.line) for p in got] == [("a\nb", 5, 1), ("c", None, 2)]


@pytest.mark.parametrize("text, name, needle", [
    ("", "p.txt", "--prompts-file=p.txt holds no prompt"),
    ("a\n\nb\n", "p.txt", "--prompts-file=p.txt line 2 is empty"),
    ("a\n   \n", "p.txt", "line 2 is empty"),
    ('{"prompt": "a"\n', "p.jsonl", "line 1 is not JSON"),
    ('["a"]\n', "p.jsonl", "line 1 is a JSON list"),
    ('{"prompt": "a", "temperature": 1}\n', "p.jsonl", "unknown keys ['temperature']"),
    ('{"max_new_tokens": 3}\n', "p.jsonl", '"prompt" must be a non-empty string, got None'),
    ('{"prompt": ""}\n', "p.jsonl", '"prompt" must be a non-empty string'),
    ('{"prompt": "a"}\n{"prompt": "b", "max_new_tokens": 0}\n', "p.jsonl",
     "line 2: max_new_tokens=0 is out of range: allowed an int >= 1"),
    ('{"prompt": "a", "max_new_tokens": 2.5}\n', "p.jsonl", "max_new_tokens=2.5 is out of range"),
    ('{"prompt": "a", "max_new_tokens": true}\n', "p.jsonl", "max_new_tokens=True is out of range"),
])
def test_malformed_lines_are_errors_naming_the_line(text, name, needle):
    with pytest.raises(ValueError, match=None) as e:
        parse(text, name)
    assert needle in str(e.value)


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        read_prompts(str(tmp_path / "none.txt"))


def test_result_record():
    res = DecodeResult(tokens=[4, 5, 6], steps=[StepStats(2, 2, 3, 2, 3), StepStats(0, 0, 1, 0, 1)],
                       seconds=0.25, stopped_by="eos", joined_seconds=0.1, first_token_seconds=0.125)
    p = parse('{"prompt": "hi", "max_new_tokens": 3}', "p.jsonl")[0]
    rec = result_record(7, p, "text", res)
    assert rec == {"index": 7, "line": 1, "prompt": "hi", "text": "text", "tokens": [4, 5, 6], "new_tokens": 3,
                   "stopped_by": "eos", "steps": 2, "mean_accepted_length": 2.0, "joined_seconds": 0.1,
                   "first_token_seconds": 0.125, "seconds": 0.25}
