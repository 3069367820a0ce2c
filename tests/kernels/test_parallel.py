"""``rheoplan.kernels.parallel``: every parallel numba kernel launched from Python threads
at once (a server decoding in threads) gives each thread its own results (the few-row
product also equal to torch's product of its operands), under numba's
default threading layer and under ``workqueue``, which aborts the process on concurrent
parallel launches unless ``launch`` makes them take turns."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# two different parallel kernels, each thread calling one of them 20 times; each result is
# compared with the one the same call gave before any thread started
THREADED = """
import threading, torch
import numba
from rheoplan.kernels.linear import cpu as linear_cpu
from rheoplan.kernels.verify import cpu as verify_cpu
g = torch.Generator().manual_seed(3)
w = torch.randn(1536, 576, generator=g)
xs = [torch.randn(r, 576, generator=g) for r in range(1, 5)]
ps = [torch.softmax(torch.randn(r, 3001, generator=g, dtype=torch.float64), -1) for r in range(2, 6)]
def draws(p, i):
    n = p.shape[0]
    return verify_cpu.root_draws(p, 7 + i, [i] * n, list(range(n)), [0] * n, 3)
want_lin = [linear_cpu.linear(x, w) for x in xs]
# each product is the product of its own operands (torch's, to float32 rounding)
bad = [("torch", i) for i, (x, y) in enumerate(zip(xs, want_lin))
       if y.shape != (x.shape[0], 1536) or not torch.allclose(y, torch.nn.functional.linear(x, w), rtol=1e-4, atol=1e-3)]
want_draw = [draws(p, i) for i, p in enumerate(ps)]
def work(kind, i):
    for _ in range(20):
        if kind == "linear":
            if not torch.equal(linear_cpu.linear(xs[i], w), want_lin[i]):
                bad.append((kind, i))
        elif draws(ps[i], i) != want_draw[i]:
            bad.append((kind, i))
ts = [threading.Thread(target=work, args=(k, i)) for k in ("linear", "draws") for i in range(4)]
[t.start() for t in ts]
[t.join() for t in ts]
print("ok", numba.threading_layer(), sorted(set(bad)))
"""


@pytest.mark.parametrize("layer", ["workqueue", "default"])
def test_threads_launching_at_once_get_their_own_results(layer):
    env = dict(os.environ)
    if layer == "workqueue":
        env["NUMBA_THREADING_LAYER"] = "workqueue"
    r = subprocess.run([sys.executable, "-c", THREADED], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[0] == "ok" and r.stdout.strip().endswith("[]"), r.stdout
    if layer == "workqueue":
        assert r.stdout.split()[1] == "workqueue"


def test_threads_follow_torchs_count():
    """``threads()`` gives numba torch's thread count (at most numba's pool), set again
    when torch's changes in the same Python thread."""
    import numba
    import torch

    from rheoplan.kernels import parallel

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert parallel.threads() == 1 and numba.get_num_threads() == 1
        torch.set_num_threads(before)
        want = min(before, numba.config.NUMBA_NUM_THREADS)
        assert parallel.threads() == want and numba.get_num_threads() == want
    finally:
        torch.set_num_threads(before)
        parallel.threads()
