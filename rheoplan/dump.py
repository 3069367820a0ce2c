"""Draw draft trees: Graphviz DOT, a networkx graph and a PNG (matplotlib, no graphviz).

The text IR and JSON (exact round-trips) live beside the IR, in ``rheoplan.ir_text``.
``draw_png`` draws on its own ``Figure`` with an Agg canvas: it never touches
matplotlib's global backend or pyplot's figure list.
"""

from __future__ import annotations

import json
import warnings

from rheoplan.ir import DraftTree, NodeKind
from rheoplan import ir_text
from rheoplan.ir_text import kind_name

__all__ = ["to_dot", "to_networkx", "draw_png", "tree_layout"]

KIND_STYLE = {  # colour per NodeKind, shared by DOT and PNG
    NodeKind.ROOT: "#4c72b0",
    NodeKind.DET: "#55a868",
    NodeKind.SAMPLED: "#dd8452",
    NodeKind.PAD: "#8c8c8c",
}
KIND_SHAPE = {NodeKind.ROOT: "doublecircle", NodeKind.DET: "box", NodeKind.SAMPLED: "ellipse",
              NodeKind.PAD: "box"}


# -- graphs ------------------------------------------------------------------------------------


def _phantoms(tree: DraftTree, b: int) -> set[int]:
    """Sampled children pruned away whose realised Y the verifier still uses."""
    out = set()
    for r in range(int(tree.n_expanded[b])):
        c = int(tree.y_node[b, r])
        if c >= 0 and bool(tree.kept[b, int(tree.exp_node[b, r])]) and not bool(tree.kept[b, c]):
            out.add(c)
    return out


def _pruned_anything(tree: DraftTree, b: int) -> bool:
    """Has ``prune`` run? Before it only the root is kept (budget >= 1 keeps some child)."""
    return tree.linear is not None or bool(tree.kept[b, 1:int(tree.n_nodes[b])].any())


def to_networkx(tree: DraftTree, b: int = 0):
    """Tree ``b`` as a ``networkx.DiGraph`` (edges parent -> child) with every node field
    as an attribute (``kind`` as its name, ``pruned`` and ``phantom`` flags)."""
    import networkx as nx

    g = nx.DiGraph(batch_index=b, prefix_len=int(tree.prefix_len[b]), rheostat=tree.rheostat,
                   slots=tree.slots)
    n = int(tree.n_nodes[b])
    phantom = _phantoms(tree, b)
    pruning_done = _pruned_anything(tree, b)
    for v in range(n):
        row = int(tree.exp_row[b, v])
        attrs = dict(kind=kind_name(int(tree.kind[b, v])), token=int(tree.token[b, v]),
                     depth=int(tree.depth[b, v]), slot=int(tree.slot[b, v]), q=float(tree.q[b, v]),
                     weight=float(tree.weight[b, v]), score=float(tree.score[b, v]),
                     kept=bool(tree.kept[b, v]), expanded=bool(tree.expanded[b, v]), exp_row=row,
                     pruned=pruning_done and not bool(tree.kept[b, v]), phantom=v in phantom)
        if row >= 0:
            attrs.update(z=float(tree.z[b, row]), y_token=int(tree.y_token[b, row]),
                         y_qtilde=float(tree.y_qtilde[b, row]))
        g.add_node(v, **attrs)
        p = int(tree.parent[b, v])
        if p >= 0:
            g.add_edge(p, v)
    return g


def _label(tree, b, v, tokenizer, sep="\\n") -> str:
    tok = int(tree.token[b, v])
    head = f"%{v} {kind_name(int(tree.kind[b, v]))}"
    if tok < 0:
        text = "?"
    elif tokenizer is not None:
        text = json.dumps(tokenizer.decode([tok]), ensure_ascii=False)[1:-1]
    else:
        text = str(tok)
    return sep.join([head, text, f"q={float(tree.q[b, v]):.3g} s={float(tree.score[b, v]):.2f}"])


def to_dot(tree: DraftTree, tokenizer=None) -> str:
    """Graphviz DOT of all trees (one cluster each). Shape and colour by NodeKind; pruned
    nodes dashed grey; pruned sampled children whose Y the verifier still uses are drawn
    dotted and labelled "phantom"."""
    out = ["digraph draft_tree {", "  rankdir=TB;", '  node [fontname="Helvetica", fontsize=10];']
    for b in range(tree.batch):
        n = int(tree.n_nodes[b])
        phantom = _phantoms(tree, b)
        pruning_done = _pruned_anything(tree, b)
        out.append(f'  subgraph cluster_{b} {{ label="tree {b} (prefix_len={int(tree.prefix_len[b])})";')
        for v in range(n):
            k = int(tree.kind[b, v])
            label = _label(tree, b, v, tokenizer).replace('"', '\\"')
            style = ["filled"]
            colour, font = KIND_STYLE.get(k, "#000000"), "black"
            if pruning_done and not bool(tree.kept[b, v]):
                style.append("dotted" if v in phantom else "dashed")
                colour, font = "#e8e8e8", "#999999"
                if v in phantom:
                    label += "\\n(phantom)"
            shape = KIND_SHAPE.get(k, "box")
            out.append(f'    n{b}_{v} [label="{label}", shape={shape}, style="{",".join(style)}", '
                       f'fillcolor="{colour}", fontcolor="{font}"];')
        for v in range(1, n):
            p = int(tree.parent[b, v])
            if p >= 0:
                faded = pruning_done and not bool(tree.kept[b, v])
                out.append(f"    n{b}_{p} -> n{b}_{v}" + (' [style=dashed, color="#bbbbbb"];' if faded else ";"))
        out.append("  }")
    out.append("}")
    return "\n".join(out)


def tree_layout(parents: list[int]) -> dict[int, tuple[float, float]]:
    """Tidy layout: leaves spread evenly on x in DFS order, each parent centred over its
    children, depth on y (root at the top, y = -depth).

    Example: parents [-1, 0, 0] -> {1: (0, -1), 2: (1, -1), 0: (0.5, 0)}.
    """
    kids: dict[int, list[int]] = {i: [] for i in range(len(parents))}
    for v, p in enumerate(parents):
        if p >= 0:
            kids[p].append(v)
    pos: dict[int, tuple[float, float]] = {}
    next_x = [0.0]

    def place(v: int, d: int) -> float:
        if not kids[v]:
            x = next_x[0]
            next_x[0] += 1.0
        else:
            xs = [place(c, d + 1) for c in kids[v]]
            x = (xs[0] + xs[-1]) / 2
        pos[v] = (x, -float(d))
        return x

    place(0, 0)
    return pos


def draw_png(tree: DraftTree, path, tokenizer=None, b: int = 0, *, show_pruned: bool = True,
             title: str | None = None) -> None:
    """Draw tree ``b`` to a PNG with matplotlib (no graphviz needed). Colour = node kind
    (legend), label = token (text when ``tokenizer`` is given), q and score; pruned nodes
    faded, phantom sampled children outlined dotted."""
    # imported here: matplotlib cost 0.4-0.9 s of importing the CLI, and every ``rheoplan`` command
    # (``generate`` too) imports this module
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    n = int(tree.n_nodes[b])
    pruning_done = _pruned_anything(tree, b)
    phantom = _phantoms(tree, b)
    shown = [v for v in range(n) if show_pruned or bool(tree.kept[b, v]) or not pruning_done]
    index = {v: i for i, v in enumerate(shown)}
    parents = [index.get(int(tree.parent[b, v]), -1) for v in shown]
    pos = tree_layout(parents)
    n_leaves = max(1, sum(1 for i in range(len(shown)) if i not in set(parents)))
    depth = max(1, max(-y for _, y in pos.values()))
    fig = Figure(figsize=(min(80, max(8, 1.25 * n_leaves)), 1.9 * (depth + 1) + 1.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for i, v in enumerate(shown):
        if parents[i] >= 0:
            (x0, y0), (x1, y1) = pos[parents[i]], pos[i]
            faded = pruning_done and not bool(tree.kept[b, v])
            ax.plot([x0, x1], [y0, y1], color="#cccccc" if faded else "#555555",
                    ls="--" if faded else "-", lw=0.8, zorder=1)
    for i, v in enumerate(shown):
        k = int(tree.kind[b, v])
        faded = pruning_done and not bool(tree.kept[b, v])
        x, y = pos[i]
        tok = int(tree.token[b, v])
        text = "?" if tok < 0 else (repr(tokenizer.decode([tok]))[1:-1] if tokenizer is not None else str(tok))
        lines = [text[:14]]
        if k != NodeKind.ROOT:
            lines.append(f"q={float(tree.q[b, v]):.3f}")
            lines.append(f"s={float(tree.score[b, v]):.2f}")
        if v in phantom:
            lines.append("phantom")
        ax.text(x, y, "\n".join(lines), ha="center", va="center", fontsize=7,
                color="#888888" if faded else "black", zorder=3,
                bbox=dict(boxstyle="round,pad=0.3", fc=KIND_STYLE.get(k, "#ffffff"),
                          alpha=0.25 if faded else 0.85, ec="#333333" if not faded else "#bbbbbb",
                          ls=":" if v in phantom else "-"))
    handles = [Line2D([], [], marker="s", ls="", markersize=10, color=KIND_STYLE[k], label=k.name)
               for k in NodeKind]
    if pruning_done:
        handles.append(Line2D([], [], marker="s", ls="", markersize=10, color=KIND_STYLE[NodeKind.DET],
                              alpha=0.25, label="pruned (faded)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.set_yticks([-d for d in range(int(depth) + 1)])
    ax.set_yticklabels([f"depth {d}" for d in range(int(depth) + 1)])
    ax.set_xticks([])
    for s in ("top", "right", "bottom"):
        ax.spines[s].set_visible(False)
    xs = [p[0] for p in pos.values()]
    ax.set_xlim(min(xs) - 0.7, max(xs) + 0.7)
    ax.set_ylim(-depth - 0.6, 0.6)
    kept = int(tree.kept[b, 1:n].sum())
    ax.set_title(title or f"draft tree {b}: {n - 1} drafted nodes, {kept} kept, "
                 f"K={tree.slots} m={tree.rheostat}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


#: names that moved to ``rheoplan.ir_text``; still importable from here, with a warning
_MOVED = ("to_text", "from_text", "to_json", "from_json", "fmt_float", "parse_float")


def __getattr__(name: str):
    if name in _MOVED:
        warnings.warn(f"rheoplan.dump.{name} moved to rheoplan.ir_text.{name}", DeprecationWarning, stacklevel=2)
        return getattr(ir_text, name)
    raise AttributeError(f"module 'rheoplan.dump' has no attribute {name!r}")
