"""Check a verifier of your own with rheoplan's exact oracle.

A verifier (a "coupling") decides the emitted token X at an expanded draft node, given
the target law p, the node's ranked draft support, the rheostat m, the slot count K and
the realised sampled token Y. It is lossless iff, averaged over Y ~ q~ (the tail law),
X ~ p at every node -- and then the whole multi-step decode emits exactly the target's
law. This script checks two home-made couplings both ways:

* ``my_rheo``: speculative sampling of Y against q~, written from scratch (lossless);
* ``my_buggy``: same acceptance, but on rejection it resamples from p itself instead of
  the residual (a classic mistake: lossy).

Run:  python examples/check_custom_verifier.py     (exit status 0 when the verdicts are right)
"""

from __future__ import annotations

import sys

import torch

from rheoplan import SamplingConfig, TreeConfig
from rheoplan.distributions import draft_probs, rank_support, tail_law, target_probs
from rheoplan.models.functional import hashed_context_lm
from rheoplan.testing import coupling_marginal_error, exact_law, target_law, total_variation


def _qtilde_dense(p, sup_token, sup_q, sup_n, m):
    qt = torch.zeros_like(p, dtype=torch.float64)
    qt[sup_token[m:sup_n]] = tail_law(sup_q, m, sup_n)
    return qt


def my_rheo(p, sup_token, sup_q, sup_n, m, K, y):
    """Law of X given Y: accept Y w.p. min(1, p/q~), else draw from norm(max(0, p - q~))."""
    p = p.to(torch.float64)
    if y < 0:  # no sampled slot at this node
        return p
    qt = _qtilde_dense(p, sup_token, sup_q, sup_n, m)
    resid = (p - qt).clamp(min=0)
    if float(resid.sum()) <= 0:  # p == q~: always accept
        out = torch.zeros_like(p)
        out[y] = 1.0
        return out
    a = min(1.0, float(p[y] / qt[y]))
    out = (1 - a) * resid / resid.sum()
    out[y] += a
    return out


def my_buggy(p, sup_token, sup_q, sup_n, m, K, y):
    """Same acceptance, but rejection resamples from p (wrong: X is biased towards Y)."""
    p = p.to(torch.float64)
    if y < 0:
        return p
    qt = _qtilde_dense(p, sup_token, sup_q, sup_n, m)
    a = min(1.0, float(p[y] / qt[y]))
    out = (1 - a) * p
    out[y] += a
    return out


def one_node_error(coupling, seed=0, V=6, m=1, K=3):
    """Marginal error at one random node (0 for a lossless coupling)."""
    g = torch.Generator().manual_seed(seed)
    s = SamplingConfig()
    p = target_probs(torch.randn(V, generator=g), s)
    q = draft_probs(torch.randn(V, generator=g), s)
    tok, sq = rank_support(q.unsqueeze(0), V)
    return coupling_marginal_error(coupling, p, tok[0], sq[0], V, m, K)


def whole_decode_tv(coupling, V=5, n_tokens=2):
    """TV between the exact law of the whole decode's first tokens and the target's."""
    target, draft = hashed_context_lm(V, seed=1, sharpness=1.5), hashed_context_lm(V, seed=2, sharpness=1.5)
    tree = TreeConfig(depth=2, frontier=2, slots=3, budget=4, rheostat=1, support=V)
    sampling = SamplingConfig(temperature=1.0)
    got = exact_law(target, draft, [0, 1], n_tokens, tree=tree, sampling=sampling, coupling=coupling)
    return total_variation(got, target_law(target, [0, 1], n_tokens, sampling))


def main() -> int:
    ok = True
    for name, coupling, lossless in [("my_rheo", my_rheo, True), ("my_buggy", my_buggy, False)]:
        node = max(one_node_error(coupling, seed) for seed in range(5))
        tv = whole_decode_tv(coupling)
        verdict = "lossless" if tv <= 1e-9 else "LOSSY"
        print(f"{name:9s} one-node marginal error {node:.2e}   whole-decode TV {tv:.2e}   -> {verdict}")
        ok &= (tv <= 1e-9) == lossless
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
