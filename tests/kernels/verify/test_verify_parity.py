"""Parity of the verification kernels with ``rheoplan.verify.coupling_sample``: emitted
tokens (and walk paths) equal exactly for the same injected uniforms and Gumbel noise."""

from __future__ import annotations

import pytest
import torch

from rheoplan import SamplingConfig, TreeConfig, plan_tree
from rheoplan.distributions import RESIDUAL_EPS, rank_support, target_probs
from rheoplan.kernels.verify import cpu, reference
from rheoplan.verify import node_y


def _rows(n, V, S, m, K, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, V, generator=g) * 2
    logits[1::4] = torch.round(logits[1::4])
    logits[2::4, : V // 3] = float("-inf")
    p = target_probs(logits, SamplingConfig(temperature=1.0))
    p[3::4] = target_probs(logits[3::4], SamplingConfig(temperature=0))  # one-hot rows
    q = torch.softmax(logits + torch.randn(n, V, generator=g), dim=-1)
    sup_token, sup_q = rank_support(q, S)
    s = sup_token.shape[1]
    y_rank = m + torch.randint(0, s - m, (n,), generator=g)
    y = sup_token.gather(1, y_rank[:, None])[:, 0]
    y[::7] = -1  # no sampled slot recorded
    u = torch.rand(n, generator=g, dtype=torch.float64)
    gum = -torch.log(-torch.log(torch.rand(n, V, generator=g, dtype=torch.float64).clamp(1e-300, 1 - 1e-16)))
    return p, sup_token, sup_q, torch.full((n,), s), y, u, gum


@pytest.mark.parametrize("verifier", ["onehot", "rheo", "ot"])
@pytest.mark.parametrize("V,S,m,K", [(30, 16, 1, 4), (30, 8, 0, 3), (64, 32, 2, 6), (10, 16, 3, 4), (20, 8, 4, 4)])
def test_coupling_rows(verifier, V, S, m, K):
    args = _rows(40, V, S, m, K, seed=V * 10 + m)
    p, tok, q, n, y, u, g = args
    ref = reference.coupling_rows(p, tok, q, n, m, K, y, verifier, u, g)
    got = cpu.coupling_rows(p, tok, q, n, m, K, y, verifier, u, g)
    assert torch.equal(ref, got)


def _walk_tree(V=12):
    """The tree the walk tests verify (same seed every call) and the generator, advanced
    past the draft's bank so callers draw their target logits from it."""
    cfg, sampling = TreeConfig(depth=3, frontier=2, slots=4, budget=8, support=8), SamplingConfig()
    gen = torch.Generator().manual_seed(3)
    bank = torch.randn(64, V, generator=gen)
    draft = lambda t, nodes: bank[(nodes.clamp(min=0) * 7 + t.cur_depth) % 64].expand(nodes.shape[0], -1, -1)
    return plan_tree(draft, [1, 2, 3], tree=cfg, sampling=sampling, seed=5), sampling, gen


def _walk_args(verifier):
    V = 12
    tree, sampling, gen = _walk_tree(V)
    lin = tree.linear
    B, L = lin.token.shape
    # peaked target logits at each linear node: the walk goes deep
    logits = torch.randn(B, L, V, generator=gen)
    logits.scatter_add_(2, lin.token.clamp(min=0)[:, :, None].roll(-1, 1), torch.full((B, L, 1), 4.0))
    p = target_probs(logits, sampling)
    u = torch.rand(B, L, generator=gen, dtype=torch.float64)
    g = -torch.log(-torch.log(torch.rand(B, L, V, generator=gen, dtype=torch.float64)))
    y = torch.tensor([[node_y(tree, b, r) for r in range(tree.y_token.shape[1])] for b in range(B)])
    args = (p, u, g, lin.token, lin.first_child, lin.n_children, lin.exp_row, tree.sup_token, tree.sup_q,
            tree.sup_n, y, tree.rheostat, tree.slots, verifier)
    return args


@pytest.mark.parametrize("verifier", ["onehot", "rheo", "ot"])
def test_walk(verifier):
    args = _walk_args(verifier)
    ref, got = reference.verify_walk(*args), cpu.verify_walk(*args)
    for name, a, b in zip(ref._fields, ref, got):
        assert torch.equal(a, b), name


@pytest.mark.interpreter
@pytest.mark.parametrize("verifier", ["onehot", "rheo", "ot"])
def test_triton_coupling_rows(device, verifier):
    from rheoplan.kernels.verify import triton as tk

    m, K = 1, 4
    args = _rows(8, 20, 8, m, K, seed=7)
    p, tok, q, n, y, u, g = args
    ref = reference.coupling_rows(p, tok, q, n, m, K, y, verifier, u, g)
    d = [x.to(device) for x in args]
    got = tk.coupling_rows(d[0], d[1], d[2], d[3], m, K, d[4], verifier, d[5], d[6], block=8)
    assert torch.equal(ref, got.cpu())


@pytest.mark.interpreter
@pytest.mark.parametrize("splits,dense_law", [(2, False), (3, False), (2, True)])
def test_triton_coupling_rows_split_vocabulary(device, splits, dense_law):
    """The vocabulary cut into chunks (one program per (row, chunk), readiness item 16):
    the same tokens; rows of equal keys (flat p, zero noise) take the first index, as
    torch.argmax, across chunk boundaries; the support's law lands in every chunk, placed
    token by token (the GPU layout) or by one dense comparison (the interpreter's)."""
    from rheoplan.kernels.verify import triton as tk

    m, K = 1, 4
    p, tok, q, n, y, u, g = _rows(8, 20, 8, m, K, seed=5)
    p[5], g[5], y[5] = 1.0 / 20, 0.0, -1  # every key equal: X is token 0
    ref = reference.coupling_rows(p, tok, q, n, m, K, y, "ot", u, g)
    assert int(ref[5]) == 0
    d = [x.to(device) for x in (p, tok, q, n, y, u, g)]
    got = tk.coupling_rows(d[0], d[1], d[2], d[3], m, K, d[4], "ot", d[5], d[6], block=4, splits=splits,
                           dense_law=dense_law)
    assert torch.equal(ref, got.cpu())


@pytest.mark.interpreter
@pytest.mark.parametrize("verifier,splits,dense_law", [("rheo", None, False), ("ot", None, False), ("ot", 2, False),
                                                      ("ot", 2, True)])
def test_triton_walk(device, verifier, splits, dense_law):
    from rheoplan.kernels.verify import triton as tk

    args = _walk_args(verifier)
    ref = reference.verify_walk(*args)
    got = tk.verify_walk(*(x.to(device) if isinstance(x, torch.Tensor) else x for x in args), block=4,
                         splits=splits, dense_law=dense_law)
    for name, a, b in zip(ref._fields, ref, got):
        assert torch.equal(a, b.cpu()), name


@pytest.mark.interpreter
def test_triton_walk_table_has_every_node(device):
    """The walk's per-node table is computed for every linear node, visited or not
    (readiness item 16: all nodes in parallel, then a walk over the table): node i's entry
    is the token rheoplan.verify.coupling_sample draws there with node i's numbers."""
    from rheoplan.kernels.verify import triton as tk
    from rheoplan.verify import coupling_sample

    p, u, g, token, first, nch, exp_row, stok, sq, sn, y, m, K, verifier = _walk_args("ot")
    B, L, V = p.shape
    E, S = stok.shape[1:]
    erow = torch.where(exp_row >= 0, exp_row + E * torch.arange(B)[:, None], -1).reshape(-1)
    d = lambda x: x.to(device)  # noqa: E731
    prop, best, arg = tk._draw_nodes(d(p.reshape(B * L, V)), d(u.reshape(-1)), d(g.reshape(B * L, V)), d(erow),
                                     d(y.reshape(-1)), d(stok.reshape(B * E, S)), d(sq.reshape(B * E, S)),
                                     d(sn.reshape(-1)), m, K, verifier, block=4, splits=2)
    table = torch.where(prop >= 0, prop, arg.gather(1, best.argmax(1, keepdim=True))[:, 0]).cpu().reshape(B, L)
    visited = reference.verify_walk(p, u, g, token, first, nch, exp_row, stok, sq, sn, y, m, K, verifier).path
    checked = 0
    for b in range(B):
        for i in range(int((token[b] >= 0).sum())):
            r = int(exp_row[b, i])
            want = (int(torch.argmax(torch.log(p[b, i]) + g[b, i])) if r < 0 else
                    coupling_sample(p[b, i], stok[b, r], sq[b, r], int(sn[b, r]), m, K, int(y[b, r]), verifier,
                                    float(u[b, i]), g[b, i]))
            assert int(table[b, i]) == want, (b, i)
            checked += int(i not in visited[b].tolist())
    assert checked > 0  # the table covers nodes the walk never reaches


@pytest.mark.interpreter
@pytest.mark.parametrize("verifier", ["rheo", "ot"])
def test_triton_native_dtype(device, verifier):
    """float32 p and gumbel go in as they are (upcast in the kernel, readiness item 15): the
    result equals the reference on the same values in float64."""
    from rheoplan.kernels.verify import triton as tk

    m, K = 1, 4
    p, tok, q, n, y, u, g = _rows(8, 20, 8, m, K, seed=11)
    p32, g32 = p.float(), g.float()
    ref = reference.coupling_rows(p32.double(), tok, q, n, m, K, y, verifier, u, g32.double())
    d = lambda x: x.to(device)  # noqa: E731
    got = tk.coupling_rows(d(p32), d(tok), d(q), d(n), m, K, d(y), verifier, d(u), d(g32), block=8)
    assert torch.equal(ref, got.cpu())


@pytest.mark.interpreter
@pytest.mark.parametrize("verifier", ["onehot", "ot"])
def test_triton_walk_in_kernel_noise(device, verifier):
    """noise=WalkNoise: the walk draws its uniforms and Gumbel noise in the kernel (readiness
    item 18) from the streams rheoplan.verify.walk reads (node = creation id, tree = batch
    index); same emitted tokens and paths as the reference given those numbers from Streams."""
    from rheoplan.kernels.verify import triton as tk
    from rheoplan.rng import Purpose, Streams

    args = list(_walk_args(verifier))
    node = plan_tree_node_ids(args)
    B, L, V = args[0].shape
    seed, step = 12345, 3
    st = Streams(seed)
    u = torch.zeros(B, L, dtype=torch.float64)
    g = torch.zeros(B, L, V, dtype=torch.float64)
    for b in range(B):
        for i in range(L):
            if node[b, i] >= 0:
                u[b, i] = st.uniform(step, b, int(node[b, i]), Purpose.VERIFY_ACCEPT, 1)[0]
                g[b, i] = st.gumbel(step, b, int(node[b, i]), Purpose.VERIFY_RESIDUAL, V)
    args[1], args[2] = u, g
    ref = reference.verify_walk(*args)
    noise = tk.WalkNoise(seed, step, node, torch.arange(B), int(Purpose.VERIFY_ACCEPT), int(Purpose.VERIFY_RESIDUAL))
    dev_args = [x.to(device) if isinstance(x, torch.Tensor) else x for x in args]
    dev_args[1] = dev_args[2] = None
    got = tk.verify_walk(*dev_args, block=8, noise=noise)
    for name, a, b in zip(ref._fields, ref, got):
        assert torch.equal(a, b.cpu()), name
    # control: another step's streams give another walk somewhere (the noise is really read)
    other = tk.verify_walk(*dev_args, block=8, noise=noise._replace(step=step + 1))
    assert not torch.equal(other.emitted.cpu(), ref.emitted)


def plan_tree_node_ids(args):
    """Creation ids of the linear nodes of the tree _walk_args planned (LinearTree.node)."""
    tree = _walk_tree()[0]
    assert torch.equal(tree.linear.token, args[3])
    return tree.linear.node


@pytest.mark.interpreter
@pytest.mark.parametrize("seed,step,tree,node,purpose", [(0, 0, 0, 0, 1), (7, 3, 2, 17, 3), (2 ** 62 + 5, 1000, 63, 499, 2)])
def test_philox_streams_bit_exact(device, seed, step, tree, node, purpose):
    """In-kernel Philox4x64-10 equals numpy's Philox behind Streams bit for bit (uniforms and,
    under the interpreter, Gumbel variables; on CUDA the Gumbel log is libdevice's: 1 ulp)."""
    from rheoplan.kernels import philox_triton as pt
    from rheoplan.rng import Streams

    st = Streams(seed)
    trees, nodes = torch.tensor([tree, tree + 1], device=device), torch.tensor([node, node], device=device)
    u = pt.streams_uniform(seed, step, trees, nodes, purpose, 37).cpu()
    assert torch.equal(u[0], st.uniform(step, tree, node, purpose, 37))
    assert torch.equal(u[1], st.uniform(step, tree + 1, node, purpose, 37))
    g = pt.streams_gumbel(seed, step, trees, nodes, purpose, 37).cpu()
    torch.testing.assert_close(g[0], st.gumbel(step, tree, node, purpose, 37), rtol=4e-16, atol=0)


@pytest.mark.parametrize("verifier", ["onehot", "rheo", "ot"])
@pytest.mark.parametrize("V,S,m,K", [(30, 16, 1, 4), (3000, 64, 1, 3), (64, 32, 2, 6), (20, 8, 4, 4)])
def test_walk_node_draw_reads_the_walks_streams(verifier, V, S, m, K):
    """``backend='numba'``'s per-node draw, which makes its own noise, emits the token the
    reference walk's rule (``_coupling_draw`` with ``Streams`` numbers, the residual
    filtered by ``gumbel_max_uniform``) emits at the same node, step and stream id; rows
    cover accepted and rejected proposals, no proposal, one-hot and truncated laws."""
    import numpy as np

    from rheoplan.rng import Purpose, Streams, philox_counter
    from rheoplan.verify import _coupling_draw, gumbel_max_uniform

    p, tok, q, n, y, _, _ = _rows(40, V, S, m, K, seed=V + m)
    st, step, key = Streams(77), 4, 2
    law = np.zeros(V)
    code = cpu.VERIFIER_CODES[verifier]
    outcomes = set()
    for r in range(p.shape[0]):
        node = 3 * r + 1
        res = lambda x, node=node: int(gumbel_max_uniform(  # noqa: E731
            x[None], st.uniform(step, key, node, Purpose.VERIFY_RESIDUAL, V)[None])[0])
        u = float(st.uniform(step, key, node, Purpose.VERIFY_ACCEPT, 1)[0])
        yr = int(y[r])
        want = _coupling_draw(p[r], tok[r], q[r], int(n[r]), m, K, yr if yr >= 0 else None, verifier, u, res)
        ctr = lambda purpose, node=node: np.array(philox_counter(step, key, node, int(purpose)), dtype=np.uint64)  # noqa: E731
        got = cpu.walk_node_draw(p[r].numpy(), tok[r].numpy(), q[r].numpy(), int(n[r]), m, K, yr, code,
                                   np.uint64(77), ctr(Purpose.VERIFY_ACCEPT), ctr(Purpose.VERIFY_RESIDUAL), law)
        assert int(got) == want, r
        assert not law.any()  # the scratch law comes back zeroed
        outcomes.add("accepted" if yr >= 0 and want == yr else "drawn")
    assert outcomes == {"accepted", "drawn"} or verifier == "onehot"


@pytest.mark.parametrize("verifier", ["rheo", "ot"])
@pytest.mark.parametrize("V,S,m,K", [(30, 16, 1, 4), (3000, 64, 1, 3), (64, 32, 2, 6), (20, 8, 0, 4)])
def test_walk_node_draw_decides_the_residual_from_the_support(verifier, V, S, m, K):
    """The per-node draw decides from the support alone that the residual has mass
    (``_mass_certain``) only where the sum over every token (``_mass_and_top``) agrees, and
    that sum's most likely token is the residual's first maximum. Rows: the test laws
    above, laws inside the support equal to the proposal (no residual: ``_mass_certain``
    must not decide) and laws inside the support with one token above it."""
    import numpy as np

    p, tok, q, n, y, _, _ = _rows(40, V, S, m, K, seed=V + 3 * m)
    code = cpu.VERIFIER_CODES[verifier]
    law = np.zeros(V)
    decided = set()
    for r in range(p.shape[0]):
        t_r, q_r, n_r = tok[r].numpy(), q[r].numpy(), int(n[r])
        yr = int(y[r]) if int(y[r]) >= 0 else int(t_r[m])
        e = cpu._write_proposal(t_r, q_r, n_r, m, K, yr, code, law)
        for kind in ("row", "equal", "above"):
            pr = p[r].numpy().copy()
            if kind != "row":  # the target law is the proposal itself, then one token above it
                pr = law.copy()
                if kind == "above":
                    pr[e] += 0.25
                    pr /= pr.sum()
            certain = cpu._mass_certain(pr, law, t_r, n_r)
            mass, top = cpu._mass_and_top(pr, law)
            resid = np.maximum(pr - law, 0.0)
            assert mass == pytest.approx(resid.sum(), rel=1e-12, abs=1e-300), (r, kind)
            assert top == (int(np.argmax(resid)) if resid.max() > 0 else -1), (r, kind)
            if certain:
                assert mass > RESIDUAL_EPS, (r, kind)
            decided.add((kind, bool(certain)))
        for i in range(n_r):
            law[t_r[i]] = 0.0
    # both ways are taken, and a law equal to the proposal is never decided from the support
    assert ("row", True) in decided and ("equal", False) in decided and ("equal", True) not in decided


@pytest.mark.parametrize("V", [30, 3001, 4096])
def test_root_draws_reads_the_walks_streams(V):
    """``root_draws`` (a batch's draft-free rows, ``rheoplan.walk.verify_roots`` on the numba
    backend), which makes each row's noise as its filter reads it, emits the token the
    reference rule (``gumbel_max_uniform`` over the ``Streams`` numbers) emits for every
    row: flat, tied, truncated and one-hot laws, rows at different steps and stream ids."""
    from rheoplan.rng import Purpose, Streams
    from rheoplan.verify import gumbel_max_uniform

    p = _rows(64, V, 8, 1, 3, seed=V)[0]
    p[4::8] = torch.softmax(torch.randn(8, V, generator=torch.Generator().manual_seed(V), dtype=torch.float64) * 0.1,
                            -1)  # nearly flat: the winner is seldom the most likely token
    st = Streams(2**40 + 9)
    steps, keys, nodes = [r % 5 for r in range(64)], [r // 2 for r in range(64)], [3 * (r % 3) for r in range(64)]
    residual = st.purpose_key(Purpose.VERIFY_RESIDUAL)
    u = torch.stack([st.uniform(a, b, c, Purpose.VERIFY_RESIDUAL, V) for a, b, c in zip(steps, keys, nodes)])
    want = gumbel_max_uniform(p, u).tolist()
    assert cpu.root_draws(p, st.seed, steps, keys, nodes, residual) == want
    assert sum(w != int(x) for w, x in zip(want, p.argmax(-1))) > 10  # the draws are not just the argmax
