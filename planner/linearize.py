"""Pass ``linearize``: order the kept nodes and emit what the verify forward and the
verifier read (docs/method.md §4 step 4), as a ``LinearTree`` on ``tree.linear``.

Order: root at 0, then kept nodes by creation id. Ids are assigned depth by depth,
so this is a depth-major BFS: parents precede children and each node's kept
children are contiguous (they were created together).
"""

from __future__ import annotations

import torch

from rheoplan.ir import DraftTree, LinearTree
from rheoplan.pipeline import PassContext, builtin_pass


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Pack a bool mask ``[..., L]`` into int64 words ``[..., ceil(L/64)]``.

    Bit ``j % 64`` of word ``j // 64`` is ``mask[..., j]`` (bit 63 is the sign bit).
    Example: ``[True, False, True]`` -> ``[0b101] = [5]``.
    """
    L = mask.shape[-1]
    W = (L + 63) // 64
    padded = torch.zeros(*mask.shape[:-1], W * 64, dtype=torch.int64)
    padded[..., :L] = mask.to(torch.int64)
    shifts = torch.arange(64, dtype=torch.int64)
    # Sum of distinct powers of two == bitwise or; int64 wraps bit 63 to the sign bit.
    return (padded.view(*mask.shape[:-1], W, 64) << shifts).sum(dim=-1)


def unpack_bits(bits: torch.Tensor, length: int) -> torch.Tensor:
    """Inverse of ``pack_bits``: int64 words ``[..., W]`` -> bool ``[..., length]``."""
    shifts = torch.arange(64, dtype=torch.int64)
    out = ((bits.unsqueeze(-1) >> shifts) & 1).bool()
    return out.flatten(-2)[..., :length]


def linearize(tree: DraftTree, ctx: PassContext) -> DraftTree:
    lin = linearize_arrays(tree.kept, tree.n_nodes, tree.parent, tree.token, tree.depth, tree.exp_row,
                           tree.prefix_len, ctx.tree_cfg.budget, ctx.tree_cfg.depth)
    return tree.replace(linear=lin)


def linearize_arrays(kept: torch.Tensor, n_nodes: torch.Tensor, parent: torch.Tensor, token: torch.Tensor,
                     depth: torch.Tensor, exp_row: torch.Tensor, prefix_len: torch.Tensor, budget: int,
                     max_depth: int) -> LinearTree:
    """The linearisation on plain arrays (``[B, M]`` node fields), shared with the kernels'
    torch reference (``rheoplan.kernels.plan.reference.linearize``)."""
    B = kept.shape[0]
    L, D = 1 + budget, max_depth
    node = torch.full((B, L), -1, dtype=torch.int64)
    tok, pos, par, dep, erow, first_child = (node.clone() for _ in range(6))
    n_children = torch.zeros(B, L, dtype=torch.int64)
    mask = torch.zeros(B, L, L, dtype=torch.bool)
    n = torch.zeros(B, dtype=torch.int64)
    all_paths = []
    for b in range(B):
        ids = torch.nonzero(kept[b, : int(n_nodes[b])]).flatten()  # ascending creation ids
        k = ids.numel()
        n[b] = k
        lin_of = {int(v): i for i, v in enumerate(ids)}
        node[b, :k], tok[b, :k], dep[b, :k] = ids, token[b, ids], depth[b, ids]
        pos[b, :k] = prefix_len[b] + depth[b, ids]
        erow[b, :k] = exp_row[b, ids]
        for i, v in enumerate(ids.tolist()):
            pv = int(parent[b, v])
            par[b, i] = lin_of[pv] if pv >= 0 else -1
            if pv >= 0:
                mask[b, i] = mask[b, lin_of[pv]]
                if first_child[b, lin_of[pv]] < 0:
                    first_child[b, lin_of[pv]] = i
                n_children[b, lin_of[pv]] += 1
            mask[b, i, i] = True
        paths = []
        for leaf in [i for i in range(k) if n_children[b, i] == 0]:
            p, i = [], leaf
            while i >= 0:
                p.append(i)
                i = int(par[b, i])
            paths.append(p[::-1])
        all_paths.append(paths)
    P = max(len(p) for p in all_paths)
    paths_t = torch.full((B, P, D + 1), -1, dtype=torch.int64)
    for b, paths in enumerate(all_paths):
        for j, p in enumerate(paths):
            paths_t[b, j, : len(p)] = torch.tensor(p)
    return LinearTree(
        n=n, node=node, token=tok, position=pos, parent=par, depth=dep,
        ancestor_mask=mask, ancestor_bits=pack_bits(mask), paths=paths_t,
        n_paths=torch.tensor([len(p) for p in all_paths], dtype=torch.int64),
        first_child=first_child, n_children=n_children, exp_row=erow,
    )


#: the pass with its implementations: torch reference (above), numba CPU, Triton
linearize_pass = builtin_pass("linearize", linearize,
                              numba="rheoplan.kernels.plan.cpu_pass:linearize",
                              triton="rheoplan.kernels.plan.triton_pass:linearize")
