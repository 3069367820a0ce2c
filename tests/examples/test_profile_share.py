"""examples/profile_share.py turns py-spy raw stacks into per-function shares: the numbers
docs/troubleshooting.md and docs/results.md quote must come out of it as stated."""

from __future__ import annotations

import runpy
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "profile_share.py"

RAW = """\
<module> (cli.py:1);_decode (rheoplan/decode.py:600);forward_tree (hf_target.py:300);linear (torch:1) 70
<module> (cli.py:1);_decode (rheoplan/decode.py:610);verify_tree (walk.py:80);walk (verify.py:250);gumbel (rng.py:70) 20
<module> (cli.py:1);_decode (rheoplan/decode.py:610);verify_tree (walk.py:80);walk (verify.py:251) 5
<module> (cli.py:1);_plan.<locals>.draft_fn (decode.py:520);head (draft.py:1) 30
<module> (cli.py:1);load (loading.py:1) 100
"""


def test_shares_count_each_function_once_per_stack_under_root():
    shares = runpy.run_path(str(EXAMPLE))["shares"]
    total, incl, own = shares(RAW.splitlines(), "_decode")
    assert total == 95  # the loading and drafting stacks are not under _decode
    assert incl["verify_tree (walk.py)"] == 25 and incl["walk (verify.py)"] == 25
    assert incl["forward_tree (hf_target.py)"] == 70
    assert own["walk (verify.py:251)"] == 5 and own["gumbel (rng.py:70)"] == 20
    total, _, _ = shares(RAW.splitlines(), "<module>", exclude="draft_fn")  # a nested name matches
    assert total == 195
