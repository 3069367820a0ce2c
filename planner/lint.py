"""IR well-formedness: the invariants every pass must leave true (torch.fx's ``lint``).

``lint(tree, ctx)`` returns a list of human-readable problems (empty when well-formed).
It is run after every pass by ``rheoplan.pipeline.VerifyAfterEach`` and, in the test
suite, by an autouse fixture.
"""

from __future__ import annotations

import math

import torch

from rheoplan.ir import DraftTree, NodeKind


def lint(tree: DraftTree, ctx=None) -> list[str]:
    problems: list[str] = []
    K, m = tree.slots, tree.rheostat
    for b in range(tree.batch):
        n = int(tree.n_nodes[b])
        say = lambda msg: problems.append(f"tree {b}: {msg}")  # noqa: E731
        if int(tree.kind[b, 0]) != NodeKind.ROOT or int(tree.parent[b, 0]) != -1 or int(tree.depth[b, 0]) != 0:
            say("node 0 is not a root (kind ROOT, parent -1, depth 0)")
        if not bool(tree.kept[b, 0]):
            say("root is not kept")
        if (tree.kind[b, n:] != -1).any() or (tree.parent[b, n:] != -1).any():
            say(f"entries past n_nodes={n} are not empty")
        for v in range(1, n):
            p = int(tree.parent[b, v])
            if not 0 <= p < v:
                say(f"node {v}: parent {p} not created before it")
                continue
            if int(tree.depth[b, v]) != int(tree.depth[b, p]) + 1:
                say(f"node {v}: depth {int(tree.depth[b, v])} != parent depth + 1")
            if not bool(tree.expanded[b, p]):
                say(f"node {v}: parent {p} is not marked expanded")
            if int(tree.depth[b, v]) < int(tree.depth[b, v - 1]):
                say(f"node {v}: ids are not depth-major")
            s, sp = float(tree.score[b, v]), float(tree.score[b, p])
            tok = int(tree.token[b, v])
            if tok >= 0 and not math.isnan(s) and s > sp:
                say(f"node {v}: score {s} above its parent's {sp}")
            if bool(tree.kept[b, v]) and not bool(tree.kept[b, p]):
                say(f"node {v}: kept but its parent {p} is not (kept set not ancestor-closed)")
        # children of each expanded node: K slots, distinct tokens, DET/SAMPLED/PAD layout
        E = int(tree.n_expanded[b])
        for row in range(E):
            v = int(tree.exp_node[b, row])
            if int(tree.exp_row[b, v]) != row:
                say(f"expansion row {row}: node {v} points to row {int(tree.exp_row[b, v])}")
            kids = torch.nonzero(tree.parent[b, :n] == v).flatten().tolist()
            if len(kids) != K:
                say(f"node {v}: {len(kids)} children, expected slots={K}")
            kinds = [int(tree.kind[b, c]) for c in kids]
            want = [NodeKind.DET] * m + ([NodeKind.SAMPLED] + [NodeKind.PAD] * (K - m - 1) if m < K else [])
            if kinds != [int(k) for k in want]:
                say(f"node {v}: child kinds {kinds}, expected {[int(k) for k in want]}")
            toks = [int(tree.token[b, c]) for c in kids if int(tree.token[b, c]) >= 0]
            if len(set(toks)) != len(toks):
                say(f"node {v}: duplicate child tokens {toks}")
            if m < K and int(tree.y_token[b, row]) >= 0:
                y = int(tree.y_token[b, row])
                top = set(tree.sup_token[b, row, :m].tolist())
                if y in top:
                    say(f"node {v}: sampled token {y} is among the top-{m} ranks")
                c = int(tree.y_node[b, row])
                if int(tree.token[b, c]) != y:
                    say(f"node {v}: sampled child {c} has token {int(tree.token[b, c])} != Y={y}")
        if tree.linear is not None:
            lin = tree.linear
            k = int(lin.n[b])
            if k != int(tree.kept[b, :n].sum()):
                say(f"linear: {k} nodes but {int(tree.kept[b, :n].sum())} kept")
            for i in range(1, k):
                pi = int(lin.parent[b, i])
                if not 0 <= pi < i:
                    say(f"linear node {i}: parent {pi} not before it")
            for i in range(k):
                if (lin.token[b, i] < 0):
                    say(f"linear node {i}: unassigned token")
    return problems
