"""``rheoplan.dump``: DOT, networkx and PNG drawings of draft trees."""

from __future__ import annotations

import matplotlib
import pytest

from _planner_helpers import PathDraft, Words
from rheoplan import SamplingConfig, TreeConfig, plan_tree
from rheoplan.dump import draw_png, to_dot, to_networkx, tree_layout


@pytest.fixture(scope="module")
def pruned_tree():
    cfg = TreeConfig(depth=3, frontier=2, slots=3, budget=4, rheostat=1, support=6)
    draft = PathDraft([[0.5, 0.1, 1.0, -0.3, 0.0, 0.7], [1.0, 1.0, 0.0, 0.0, -1.0, 2.0], [3, 0, 0, 0, 0, 0]])
    return plan_tree(draft, [1, 2], tree=cfg, sampling=SamplingConfig(), seed=11)


def test_dot_styles_kinds_pruned_and_phantoms(pruned_tree):
    dot = to_dot(pruned_tree, tokenizer=Words())
    assert dot.startswith("digraph draft_tree {") and dot.rstrip().endswith("}")
    assert "cluster_0" in dot and "cluster_1" in dot
    assert "shape=doublecircle" in dot and "shape=ellipse" in dot  # ROOT, SAMPLED
    assert 'style="filled,dashed"' in dot  # pruned
    has_phantom = any(int(pruned_tree.y_node[b, r]) >= 0 and not pruned_tree.kept[b, int(pruned_tree.y_node[b, r])]
                      and pruned_tree.kept[b, int(pruned_tree.exp_node[b, r])]
                      for b in range(2) for r in range(int(pruned_tree.n_expanded[b])))
    assert has_phantom and "(phantom)" in dot
    assert dot.count(" -> ") == int(pruned_tree.n_nodes.sum()) - 2


def test_networkx_graph_has_node_attributes(pruned_tree):
    g = to_networkx(pruned_tree, b=1)
    n = int(pruned_tree.n_nodes[1])
    assert g.number_of_nodes() == n and g.number_of_edges() == n - 1
    assert g.nodes[0]["kind"] == "ROOT" and "z" in g.nodes[0]
    assert {a["kind"] for _, a in g.nodes(data=True)} == {"ROOT", "DET", "SAMPLED", "PAD"}
    assert sum(a["kept"] for _, a in g.nodes(data=True)) == 5
    assert all(g.nodes[v]["pruned"] != g.nodes[v]["kept"] for v in g.nodes)


def test_draw_png_writes_an_image(pruned_tree, tmp_path):
    assert tree_layout([-1, 0, 0]) == {1: (0.0, -1.0), 2: (1.0, -1.0), 0: (0.5, 0.0)}
    path = tmp_path / "tree.png"
    draw_png(pruned_tree, path, tokenizer=Words(), b=0)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_draw_png_leaves_matplotlib_global_state_alone(pruned_tree, tmp_path):
    """No backend switch and no figure left in pyplot's list (it draws on its own Figure)."""
    import matplotlib.pyplot as plt

    backend, figures = matplotlib.get_backend(), plt.get_fignums()
    draw_png(pruned_tree, tmp_path / "t.png")
    assert matplotlib.get_backend() == backend
    assert plt.get_fignums() == figures


def test_moved_text_functions_still_import_with_a_warning():
    from rheoplan import dump, ir_text

    with pytest.warns(DeprecationWarning, match="rheoplan.ir_text.to_text"):
        assert dump.to_text is ir_text.to_text
    with pytest.raises(AttributeError):
        dump.no_such_name
