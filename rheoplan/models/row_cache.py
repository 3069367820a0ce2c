"""``RowCache``: one transformers ``DynamicCache`` shared by the B rows of a batched decode.

Rows hold different numbers of committed tokens and accept paths of different lengths
every step, so a row's entries do not sit at the same columns as another row's. Instead of
moving them, the cache keeps a per-row bool ``valid [B, S]``: column ``j`` of row ``b``
is a committed entry of that row. Everything else is a *hole* (left padding of a shorter
prompt, a rejected tree node, another row's longer path) that no query attends to: every
forward passes a 4D mask built from ``valid``. Positions are explicit per row (RoPE is
applied before a key is cached), so holes never shift a row's positions.

Holes cost memory and attention work, so ``compact`` (run by ``maybe_compact`` when more
than half of the widest row's columns are holes) gathers every row's valid entries to the
left, in order.

The cache itself is transformers' own (``DynamicCache``, one ``[B, kv_heads, S, head_dim]``
tensor per layer); only the mask and the compaction are ours.
``tests/rheoplan/models/test_row_cache.py`` checks it against a plain forward of each row
and against transformers' own left-padded batch forward.
"""

from __future__ import annotations

import torch

from rheoplan.kernels.cache_moves import move_columns
from rheoplan.models._hf_common import _layer_tensors, new_cache, run_base_rows
from rheoplan.models.growing_cache import narrow_layer
from rheoplan.mutation import active


class RowCache:
    """A ``DynamicCache`` for ``batch`` rows plus which columns each row may attend to."""

    def __init__(self, model: torch.nn.Module, batch: int, device: torch.device) -> None:
        self.cache = new_cache(model)
        self.device = device
        self.valid = torch.zeros(batch, 0, dtype=torch.bool, device=device)  #: [B, S]

    @property
    def batch(self) -> int:
        return self.valid.shape[0]

    @property
    def width(self) -> int:
        """Columns S of the cache (committed entries and holes of every row)."""
        return self.valid.shape[1]

    def lengths(self) -> list[int]:
        """Committed entries per row."""
        return self.valid.sum(1).tolist()

    def forward(self, base: torch.nn.Module, tokens: torch.Tensor, positions: torch.Tensor,
                block: torch.Tensor, extra: torch.Tensor | None = None, **attention_kwargs) -> torch.Tensor:
        """Forward ``tokens [B, q]`` at ``positions [B, q]``; returns hidden ``[B, q, H]``.

        Query ``i`` of row ``b`` sees row ``b``'s committed entries, the earlier columns
        ``extra[b, i]`` (``[B, q, S]``, e.g. this step's draft nodes that are its ancestors)
        and the new entries ``block[b, i]`` (``[B, q, q]``). The new columns are appended as
        holes; ``keep`` makes them committed entries.
        """
        B, q = tokens.shape
        S = self.width
        seen = self.valid
        if active("batch_shift_rows") and B > 1:
            seen = seen.roll(1, dims=0)  # test-only: every row attends to its neighbour's entries
        prefix = seen[:, None, :].expand(B, q, S)
        if extra is not None:
            prefix = prefix | extra.to(self.device)
        allowed = torch.cat([prefix, block.to(device=self.device, dtype=torch.bool)], dim=2)
        hidden = run_base_rows(base, self.cache, tokens.to(self.device), positions.to(self.device),
                               allowed, **attention_kwargs)
        self.valid = torch.cat([self.valid, torch.zeros(B, q, dtype=torch.bool, device=self.device)], dim=1)
        return hidden

    def keep(self, cols: list[list[int]]) -> None:
        """Make columns ``cols[b]`` committed entries of row ``b``."""
        for b, c in enumerate(cols):
            if c:
                self.valid[b, torch.as_tensor(c, dtype=torch.int64, device=self.device)] = True

    def commit_paths(self, start: int, paths: list[list[int]]) -> None:
        """Commit each row's accepted tree entries: columns ``start + paths[b][j]`` of row
        ``b`` (a forward's new columns begin at ``start``) move to ``start + j`` and become
        committed entries; every column after ``start + max(len(path))`` is dropped.

        Why not ``keep`` the entries where they are: a step's rejected nodes would stay as
        holes (an 8-node tree leaving ~6 per row per step) that every later forward masks
        and attends over until ``compact``. Moving only the tree's part costs O(tree) per
        layer, as ``commit_cache`` does for one sequence, and leaves holes only where
        another row accepted a longer path: one row keeps no holes at all, its cache laid
        out as the single-sequence cache is.
        """
        if len(paths) != self.batch:
            raise ValueError(f"paths holds {len(paths)} paths for {self.batch} rows")
        if bool(self.valid[:, start:].any()):
            raise AssertionError("commit_paths: columns after start are committed already")
        q = self.width - start
        m = max((len(p) for p in paths), default=0)
        if any(j < 0 or j >= q for p in paths for j in p):
            raise ValueError(f"paths hold tree columns outside [0, {q})")
        moves = any(j != k for p in paths for k, j in enumerate(p))
        held = []
        # nothing to move and nothing to drop (every row kept all of its columns in order: a
        # batch of plain steps, one column each): the layers' tensors stay as they are
        for holder, k, v in _layer_tensors(self.cache) if moves or m < q else ():
            keys = getattr(holder, k)
            if keys is not None and keys.numel():
                held.append((holder, keys, getattr(holder, v)))
        if moves:
            # one numba call per tensor (a path runs forward: every source is read before it
            # is overwritten); torch's gather where the kernel does not apply
            move_columns([(keys, vals) for _, keys, vals in held], start, paths)
        for holder, _, _ in held:
            narrow_layer(holder, start + m)
        lens = torch.tensor([len(p) for p in paths], dtype=torch.int64, device=self.device)
        tail = torch.arange(m, device=self.device)[None, :] < lens[:, None]
        self.valid = torch.cat([self.valid[:, :start], tail], dim=1)

    def drop_tail(self, width: int) -> None:
        """Forget every column at or after ``width`` (they must not be committed anywhere)."""
        if width >= self.width:
            return
        if bool(self.valid[:, width:].any()):
            raise AssertionError("drop_tail would drop committed entries")
        for holder, k, v in _layer_tensors(self.cache):
            keys = getattr(holder, k)
            if keys is None or keys.numel() == 0:
                continue
            setattr(holder, k, keys[:, :, :width])
            setattr(holder, v, getattr(holder, v)[:, :, :width])
        self.valid = self.valid[:, :width]

    def trim(self) -> None:
        """Drop trailing columns that are holes in every row (a cheap view)."""
        used = self.valid.any(0).nonzero()
        self.drop_tail(int(used[-1]) + 1 if used.numel() else 0)

    def maybe_compact(self) -> bool:
        """``trim``, then ``compact`` when more than half of the columns are holes in the
        fullest row (and there are at least 64 of them). Returns whether it compacted."""
        self.trim()
        n = max(self.lengths(), default=0)
        if self.width - n >= max(64, n):
            self.compact()
            return True
        return False

    def compact(self) -> None:
        """Move every row's committed entries to the left, in order; the rest are holes."""
        lengths = self.valid.sum(1)
        n = int(lengths.max()) if lengths.numel() else 0
        # stable order: committed columns first (in column order), then holes
        order = torch.argsort((~self.valid).to(torch.int8), dim=1, stable=True)[:, :n]  # [B, n]
        for holder, k, v in _layer_tensors(self.cache):
            keys = getattr(holder, k)
            if keys is None or keys.numel() == 0:
                continue
            idx = order[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[3]).to(keys.device)
            setattr(holder, k, keys.gather(2, idx))
            vals = getattr(holder, v)
            setattr(holder, v, vals.gather(2, idx))
        self.valid = torch.arange(n, device=self.device)[None, :] < lengths[:, None]

    def extend(self, other: "RowCache") -> None:
        """Append ``other``'s rows after this cache's (rows joining a running batch): the
        narrower cache gets hole columns on the right, then the two are stacked."""
        W = max(self.width, other.width)
        for (h1, k, v), (h2, _, _) in zip(_layer_tensors(self.cache), _layer_tensors(other.cache)):
            a, b = _kv(h1, k, v), _kv(h2, k, v)
            if a is None and b is None:
                continue
            ref = a if a is not None else b
            a = a if a is not None else _zeros(ref, self.batch)
            b = b if b is not None else _zeros(ref, other.batch)
            keys = torch.cat([_pad(a[0], W), _pad(b[0], W)], dim=0)
            vals = torch.cat([_pad(a[1], W), _pad(b[1], W)], dim=0)
            setattr(h1, k, keys)
            setattr(h1, v, vals)
            if hasattr(h1, "is_initialized"):
                h1.is_initialized = True
                h1.device = keys.device
        pad = lambda m: torch.cat([m, torch.zeros(m.shape[0], W - m.shape[1], dtype=torch.bool,  # noqa: E731
                                                 device=self.device)], dim=1)
        self.valid = torch.cat([pad(self.valid), pad(other.valid.to(self.device))], dim=0)

    def select(self, rows: list[int]) -> None:
        """Keep only rows ``rows`` (in that order), then ``maybe_compact``."""
        idx = torch.as_tensor(rows, dtype=torch.int64, device=self.device)
        for holder, k, v in _layer_tensors(self.cache):
            keys = getattr(holder, k)
            if keys is None or keys.numel() == 0:
                continue
            setattr(holder, k, keys.index_select(0, idx.to(keys.device)))
            setattr(holder, v, getattr(holder, v).index_select(0, idx.to(keys.device)))
        self.valid = self.valid.index_select(0, idx)
        self.maybe_compact()


def _kv(holder, k: str, v: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    keys = getattr(holder, k, None)
    if keys is None or keys.numel() == 0:
        return None
    return keys, getattr(holder, v)


def _zeros(ref: tuple[torch.Tensor, torch.Tensor], batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Width-0 keys and values of ``batch`` rows shaped like ``ref``'s."""
    k, v = ref
    return (k.new_zeros(batch, k.shape[1], 0, k.shape[3]), v.new_zeros(batch, v.shape[1], 0, v.shape[3]))


def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x [B, H, S, D]`` with hole columns (zeros) appended up to ``width``."""
    if x.shape[2] == width:
        return x
    return torch.cat([x, x.new_zeros(x.shape[0], x.shape[1], width - x.shape[2], x.shape[3])], dim=2)
