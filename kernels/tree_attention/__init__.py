"""Attention for the verify forward: each tree query attends to its request's cached
prefix and, inside the tree block, to itself and its ancestors (ancestor bit-words from
``LinearTree.ancestor_bits``). Grouped-query heads. ``reference`` = torch SDPA with a
dense mask; ``triton`` = a flash-attention style kernel with online softmax.

There is no numba path: on CPU the verify forward runs in torch (the model's own
attention with the dense ``ancestor_mask``), so a CPU kernel would have no caller.
"""
