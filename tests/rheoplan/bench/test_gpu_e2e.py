"""``rheoplan.bench.gpu_e2e`` on the CPU (``--smoke``: toy models, Triton interpreter): every
row kind of the GPU run goes through once, so the one-shot GPU run cannot die on a bug of
the script itself. Times printed here mean nothing."""

from __future__ import annotations

import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported


@pytest.mark.slow
def test_smoke_rows(tmp_path, capsys):
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU smoke run under TRITON_INTERPRET=1 only")
    from rheoplan.bench import gpu_e2e

    # the time budget is the GPU run's; here every row must run, also on a loaded machine where
    # the interpreter takes minutes (the rows finish well inside it on an idle one)
    rc = gpu_e2e.main(["--smoke", "--out", str(tmp_path), "--tokens", "3", "--warmup-tokens", "1",
                       "--count-tokens", "1", "--temperatures", "1", "--impls", "triton", "numba", "generate",
                       "--budget", "900"])
    rows = json.loads((tmp_path / "gpu_e2e.json").read_text())
    assert rc == 0, [r["error"] for r in rows]
    kinds = {(r["draft"], r["impl"]) for r in rows}
    assert kinds == {("none", "generate"), ("eagle3", "triton"), ("eagle3", "numba"), ("self", "triton"),
                     ("self", "numba")}
    for r in rows:
        assert r["ok"] and r["tokens"] == 3 and r["tokens_per_s"] > 0, r
        if r["impl"] != "generate":
            assert set(r["phase_ms_per_step"]) >= {"draft", "plan", "verify_forward", "walk", "commit"}
            assert r["same_tokens_as_numba"] in (None, True), r  # float32: the kernels change no token
            # the 12 most frequent sites: all of the count where there are fewer
            total = sum(r["sync_sites"].values())
            assert total <= r["host_syncs_per_step"] + 1e-9, r
            assert len(r["sync_sites"]) == 12 or abs(total - r["host_syncs_per_step"]) < 1e-9, r
            assert all(":" in site for site in r["sync_sites"]), r
            assert r["compiles_in_timing"] == 0, r  # interpreted kernels compile nothing
    assert "token check vs numba rows" in capsys.readouterr().out


def test_bad_arguments_rejected(tmp_path):
    from rheoplan.bench import gpu_e2e

    with pytest.raises(SystemExit):
        gpu_e2e.main(["--smoke", "--tokens", "0", "--out", str(tmp_path)])
