"""Planner bookkeeping kernels for B ragged trees (docs/method.md §3-4): frontier
top-k per depth, global top-N pruning, linearisation (positions, parents, ancestor
bit-words, first_child / n_children, root-to-leaf paths).

Ranking everywhere: higher score first, then lower node id (``rheoplan.ir.rank_key_order``;
NaN scores rank last). ``reference`` (torch, the planner passes' own code), ``cpu``
(numba) and ``triton`` (one program per tree) share the signatures.
"""
