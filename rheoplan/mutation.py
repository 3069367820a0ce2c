"""Test-only lossy switches (mutation controls), off unless a test turns them on.

Every losslessness test must be shown to fail on a deliberately broken variant. The
variants live here, as named switches read by the code they break, so no public
signature carries them: turn them on with ``rheoplan.testing.mutation(...)``, a context
manager (a ``contextvars`` variable, so a switch never leaks out of its ``with`` block
or into another thread).

* ``"skip_pruned_sampled"`` (control (a), read by ``rheoplan.verify.node_y``): when the
  sampled child was pruned, ignore ``Y`` and draw ``X ~ p``. Exact only with a
  ``Y``-independent proxy; lossy with ``proxy='true_q'``.
* ``"raw_q_ratio"`` (control (b), read by ``rheoplan.verify``): use the raw draft ``q``
  instead of the tail law ``q~`` in the acceptance ratio and in the residual.
* ``"reuse_draft_stream"`` (control (c), read by ``rheoplan.rng.Streams``): verification
  draws from the draft stream, so the accept uniform at a node is the uniform that gave
  the first tail token its Gumbel noise when ``Y`` was drawn there.

* ``"batch_shift_rows"`` (batched decoding, read by ``rheoplan.models.row_cache``): every row
  of a batched transformers forward attends to the next row's committed entries instead of
  its own (mixed-up row masks).
* ``"batch_keep_first_rows"`` (batched decoding, read by ``rheoplan.decode``): when rows
  finish, the models keep the first rows of the batch instead of the rows still decoding
  (the bookkeeping error of rows leaving a batch: a live row gets a finished row's state).
* ``"batch_shared_root_noise"`` (batched decoding, read by ``rheoplan.verify.walk_roots``):
  the rows that draw their token together take the first row's Gumbel noise (each row's
  law stays exact; the rows are no longer independent).

* ``"served_root_stale"`` (read by ``rheoplan.models.hf_target``): the first new token,
  served from the prompt's forward (``start_and_root``), is drawn from the output at the
  prompt's second-to-last token instead of its last (an off-by-one in the served root).

* ``"model_copy_bf16"`` (read by ``rheoplan.models.gguf_copy``): the converted copy of a
  GGUF model stores its weights rounded through bfloat16 (a copy that is another model).

docs/method.md ("Mutation controls") says which test detects which switch.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator

#: every switch: the controls (a), (b), (c), the three batched-decoding controls, the served
#: root's, the converted model copy's
MUTATIONS = ("skip_pruned_sampled", "raw_q_ratio", "reuse_draft_stream", "batch_shift_rows",
             "batch_keep_first_rows", "batch_shared_root_noise", "served_root_stale", "model_copy_bf16")

_ACTIVE: ContextVar[frozenset[str]] = ContextVar("rheoplan_mutations", default=frozenset())


def active(name: str) -> bool:
    """True while switch ``name`` is on (inside ``rheoplan.testing.mutation(name)``)."""
    return name in _ACTIVE.get()


@contextmanager
def mutation(*names: str) -> Iterator[frozenset[str]]:
    """Turn the lossy switches ``names`` on inside the ``with`` block (test-only).

    Example:
        >>> with mutation("raw_q_ratio"):
        ...     active("raw_q_ratio")
        True
        >>> active("raw_q_ratio")
        False
    """
    for n in names:
        if not isinstance(n, str):
            raise TypeError(f"mutation name {n!r} is a {type(n).__name__}: allowed one of {MUTATIONS}")
    unknown = sorted(n for n in names if n not in MUTATIONS)
    if unknown:
        raise ValueError(f"mutation names {unknown} are unknown: allowed {MUTATIONS} "
                         "(test-only lossy variants)")
    token = _ACTIVE.set(_ACTIVE.get() | frozenset(names))
    try:
        yield _ACTIVE.get()
    finally:
        _ACTIVE.reset(token)
