"""The two model interfaces the decode loop talks to (batch 1 per decode).

A decode step, in the order the loop calls these methods:

1. ``draft.node_logits(tree, nodes)`` once for the root (``nodes == [0]``), then once
   per depth for the frontier nodes. Every node's ancestors were passed in an earlier
   call of the same step (the root's ancestors are the committed context).
2. ``target.forward_tree(linear)`` runs the root and every kept drafted node in one
   forward with the ancestor mask; it returns a ``TreeLogits`` whose ``logits(i)`` the
   verifier asks for only at the linear nodes it visits (lazy output projection).
3. ``target.commit(path)`` and ``draft.commit(tree, path_nodes, tokens, features)``
   keep the root and the accepted nodes; the bonus token becomes the next root
   and is *not* cached by either model until the next step.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from rheoplan.ir import DraftTree, LinearTree


class TreeLogits(Protocol):
    """Result of one verify forward (tree b = 0)."""

    def logits(self, i: int) -> torch.Tensor:
        """Raw next-token logits ``[V]`` (float32) at linear node ``i``."""

    def features(self, i: int) -> torch.Tensor | None:
        """Target hidden features at linear node ``i`` for an EAGLE-3 head, or None."""


@runtime_checkable
class TargetModel(Protocol):
    vocab_size: int

    def start(self, prompt_ids: list[int]) -> None:
        """Reset; cache every prompt token except the last (the first root)."""

    def forward_tree(self, linear: LinearTree) -> TreeLogits:
        """Verify forward of tree 0 of ``linear`` (root not cached yet)."""

    def commit(self, path: list[int]) -> None:
        """Keep in the cache linear nodes ``path`` (root first, then accepted nodes)."""


@runtime_checkable
class DraftModel(Protocol):
    vocab_size: int

    def start(self, prompt_ids: list[int]) -> None:
        """Reset; the last prompt token is the first root."""

    def node_logits(self, tree: DraftTree, nodes: list[int]) -> torch.Tensor:
        """Draft next-token logits ``[len(nodes), V]`` (target vocabulary ids; tokens the
        draft cannot propose get ``-inf``) at nodes of tree 0."""

    def commit(self, tree: DraftTree, path_nodes: list[int], emitted: list[int],
               features: list[torch.Tensor | None]) -> None:
        """The step accepted creation ids ``path_nodes`` (root first) and emitted
        ``emitted`` (accepted drafted tokens then the bonus token). ``features`` holds the
        target's features at the root and each accepted node, for heads that need them."""
