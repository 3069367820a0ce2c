"""examples/serve_mixed_lengths.py counts each request's tokens as it asked for them (up to
its budget and its EOS) and refuses bad ranges before loading the model."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "serve_mixed_lengths.py"


def test_a_request_ends_at_its_budget_or_its_first_eos():
    cut = runpy.run_path(str(EXAMPLE))["cut"]
    assert cut([5, 6, 7, 8], 3, {2}) == [5, 6, 7]
    assert cut([5, 2, 7, 2], 4, {2}) == [5, 2]  # the EOS is kept
    assert cut([5, 6, 2], 2, {2}) == [5, 6]  # an EOS past the budget does not count
    assert cut([9, 3], 5, {2, 3}) == [9, 3]


def test_percentile_interpolates_between_order_statistics():
    percentile = runpy.run_path(str(EXAMPLE))["percentile"]
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0], 0.9) == pytest.approx(10.0)
    assert percentile([7.0], 0.9) == 7.0


@pytest.mark.parametrize("argv, message", [
    (["--max-tokens", "8", "--min-tokens", "9"], "--max-tokens=8 is out of range: allowed >= 9"),
    (["--requests", "41"], "--requests=41 is out of range: allowed 1..40"),
    (["--temperature", "-1"], "--temperature=-1.0 is out of range: allowed >= 0"),
])
def test_bad_ranges_are_refused_before_any_work(argv, message, capsys):
    main = runpy.run_path(str(EXAMPLE))["main"]
    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err
