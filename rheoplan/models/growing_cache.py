"""``GrowingLayer``: a transformers ``DynamicLayer`` that appends in place instead of copying.

transformers' ``DynamicLayer.update`` appends a forward's new keys and values with
``torch.cat``, which copies the layer's whole cache on every forward: O(context) per
step, which grows with the rows and the context. On the 2-core CPU (SmolLM2-135M,
bfloat16, one-token steps, alternating runs) in-place appends took 16 rows at 600 cached
tokens from 76.1 to 61.7 ms per step and one row at 1500 cached tokens from 31.9 to 28.8
ms; at ~150 cached tokens the copy is ~1 ms of a 16-row step and no difference stood out
of the machine's spread. One append costs 8-10 us against ``torch.cat``'s 9 / 20 / 57 us
at 1 / 4 / 16 rows and ~150 cached tokens (docs/batch.md, "The KV cache").

``GrowingLayer`` keeps each tensor in a buffer with spare columns and hands out the prefix
view ``buffer[:, :, :length]``; appending writes into the spare columns, and only a full
buffer is copied into a larger one (half as large again, at least 64 columns more), so
appends cost amortised O(new tokens). Every way rheoplan rewrites a cache keeps working:

* dropping or committing the tail (``crop_cache``, ``commit_cache``,
  ``RowCache.commit_paths`` / ``drop_tail``) narrows the view or writes inside it: still a
  prefix of the buffer, and the next append overwrites the dropped columns;
* replacing the tensor (``select_cache``, ``RowCache.compact`` / ``select`` / ``extend``:
  gathers that make new tensors) leaves a tensor that is not the buffer's prefix: the next
  append copies it into a new buffer, once.

The values a forward sees are exactly those ``torch.cat`` would give (the same entries,
in a strided view); ``tests/rheoplan/models/test_growing_cache.py`` checks the layer
against ``DynamicLayer`` through appends, narrows, in-place moves and replacements.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

#: spare columns a new buffer gets: half its length, at least this many
MIN_SPARE = 64


def capacity(columns: int) -> int:
    """Columns of a new buffer that must hold ``columns``: half as many again as spare, at
    least ``MIN_SPARE`` (``forward_memory`` counts a cache at this width)."""
    return columns + max(MIN_SPARE, columns // 2)


def _is_prefix(cur: torch.Tensor, buf: torch.Tensor | None) -> bool:
    """Whether ``cur`` is the view ``buf[:, :, :n]`` (same storage start, strides, and
    batch / head / head-dim sizes)."""
    return (buf is not None and cur.dim() == 4 and cur.data_ptr() == buf.data_ptr()
            and cur.stride() == buf.stride() and cur.shape[:2] == buf.shape[:2] and cur.shape[3] == buf.shape[3]
            and cur.shape[2] <= buf.shape[2] and cur.dtype == buf.dtype)


def append(cur: torch.Tensor, buf: torch.Tensor | None, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(torch.cat([cur, new], dim=2), its buffer)``: written into ``buf``'s spare columns
    when ``cur`` is ``buf``'s prefix and they fit, else into a new buffer with spare columns.
    ``cur`` may be empty (no entries yet)."""
    n = cur.shape[2] if cur.dim() == 4 else 0
    q = new.shape[2]
    if n + q <= (buf.shape[2] if buf is not None else 0) and _is_prefix(cur, buf) and buf.device == new.device:
        buf[:, :, n:n + q] = new
        return buf[:, :, :n + q], buf
    size = n + q
    grown = new.new_empty(new.shape[0], new.shape[1], capacity(size), new.shape[3])
    if n:
        grown[:, :, :n] = cur
    grown[:, :, n:size] = new
    return grown[:, :, :size], grown


class GrowingLayer(DynamicLayer):
    """``DynamicLayer`` whose ``update`` appends into a buffer with spare columns
    (``append``) instead of ``torch.cat``; ``keys`` / ``values`` stay plain tensors (views),
    so code that reads, narrows or replaces them works as on ``DynamicLayer``.

    Why the fast path: a step calls ``update`` twice per layer (60 times for SmolLM2), so
    its Python overhead matters as much as the copy it saves at short contexts. While
    ``keys`` / ``values`` are still the views the last ``update`` handed out, or those
    views narrowed by ``narrow_layer`` (a commit, a crop: still the buffer's prefixes), and
    the new columns fit, it writes them and hands out the longer views without
    ``append``'s checks; a tensor replaced from outside goes through ``append`` once."""

    # class defaults: a layer that something else initialised (``RowCache.extend`` sets
    # ``keys`` / ``values`` and ``is_initialized`` directly) has no buffer yet
    _key_buffer: torch.Tensor | None = None
    _value_buffer: torch.Tensor | None = None
    _views: tuple = (None, None)  # the (keys, values) the last update handed out

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._key_buffer = self._value_buffer = None
        self._views = (None, None)

    def free_column(self, rows: int, q: int) -> int | None:
        """The column ``n`` from which ``q`` new entries of ``rows`` rows can be written
        straight into the buffers (``key_buffer[:, :, n:n + q]``, the value buffer alike),
        ``update``'s fast path: ``keys`` / ``values`` are still the views the last ``update``
        handed out (or those narrowed by ``narrow_layer``), of ``rows`` rows, and the buffers
        have room; else None (``update`` then appends as it must)."""
        keys = self.keys
        if (self._key_buffer is None or keys is not self._views[0] or self.values is not self._views[1]
                or keys.shape[0] != rows):
            return None
        n = keys.shape[2]
        return n if n + q <= self._key_buffer.shape[2] else None

    @property
    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The (keys, values) buffers ``free_column`` speaks of."""
        return self._key_buffer, self._value_buffer

    def written(self, n: int, q: int) -> tuple[torch.Tensor, torch.Tensor]:
        """After columns ``n`` to ``n + q`` of the buffers were written (``free_column``):
        hand out keys and values ``n + q`` long, as ``update`` returns them."""
        self.keys = self._key_buffer.narrow(2, 0, n + q)
        self.values = self._value_buffer.narrow(2, 0, n + q)
        self._views = (self.keys, self.values)
        return self.keys, self.values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[2]
        n = self.free_column(key_states.shape[0], q)
        if n is not None:
            self._key_buffer.narrow(2, n, q).copy_(key_states)
            self._value_buffer.narrow(2, n, q).copy_(value_states)
            return self.written(n, q)
        keys, values = self.keys, self.values
        self.keys, self._key_buffer = append(keys, self._key_buffer, key_states)
        self.values, self._value_buffer = append(values, self._value_buffer, value_states)
        self._views = (self.keys, self.values)
        return self.keys, self.values

    def reset(self) -> None:
        super().reset()
        self._key_buffer = self._value_buffer = None
        self._views = (None, None)


def narrow_layer(layer, length: int) -> None:
    """Keep the first ``length`` entries of ``layer``'s keys and values (views: nothing is
    copied). A ``GrowingLayer`` whose tensors were the views its last ``update`` handed out
    keeps ``update``'s fast path: the narrowed views are prefixes of the same buffers.

    Why: a commit or a crop narrows every layer after each tree step, and ``update`` then
    took ``append``'s checks (two calls a layer) on every layer of the next
    forward: 7,500 of 7,800 ``append`` calls over four T = 1 decodes, at ~8 us each
    (docs/results.md, "Twenty-fourth round")."""
    keys, values = layer.keys, layer.values
    fast = isinstance(layer, GrowingLayer) and keys is layer._views[0] and values is layer._views[1]
    layer.keys, layer.values = keys.narrow(2, 0, length), values.narrow(2, 0, length)
    if fast:
        layer._views = (layer.keys, layer.values)


def growing_layers(cache, n: int) -> list | None:
    """``cache``'s first ``n`` layers, each a ``GrowingLayer`` or None, where a caller may
    append to a layer itself (``free_column``, then ``written``) instead of through
    ``cache.update``: transformers' own ``Cache.update`` (which, without offloading, only
    calls the layer's ``update``), no offloading, and all ``n`` layers there; else None
    (``rheoplan.models.lean_llama``'s one rotary-and-append call per layer asks this once a
    forward)."""
    layers = getattr(cache, "layers", None)
    if (type(cache).update is not Cache.update or getattr(cache, "offloading", True) or layers is None
            or len(layers) < n):
        return None
    return [x if type(x) is GrowingLayer else None for x in layers[:n]]


def grow_in_place(cache) -> None:
    """Swap every plain ``DynamicLayer`` of a fresh transformers ``DynamicCache`` for a
    ``GrowingLayer`` (other layer kinds, e.g. sliding windows, stay as they are)."""
    for i, layer in enumerate(getattr(cache, "layers", [])):
        if type(layer) is DynamicLayer and not layer.is_initialized:
            cache.layers[i] = GrowingLayer()
