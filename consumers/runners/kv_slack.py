"""KV cache layers with room to grow: steps and joins write in place instead of copying the cache.

transformers' `DynamicLayer` appends every step's keys and values with
`torch.cat`, which copies the layer's whole cache each step; merging joiners
by stacking copies it again at every join. With a running set those copies
grow with rows x width and came to dominate: 128 rows at ~160 cached tokens
took 644 ms per step against 399 ms at 40 tokens (SmolLM2-135M, one CPU
thread), `aten::cat` ~70% of a step's CPU in torch's profiler, and a join of
four requests cost ~0.5 s, mostly the copy.

A `SlackLayer` is a view `[rows, start:end)` of a larger zeroed buffer with
spare columns (`SLACK`) and spare rows: a step writes one column, a joiner
is written into a free row (a finished row's, or a spare one), and trimming
padding columns moves `start`. The cache is copied only when columns run out
(every `SLACK` steps, or a quarter of the width when that is more), when
rows run out, and when the set shrinks (compaction). Positions never exposed
by the view are zero, never garbage: masked keys still pass through
attention's arithmetic.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from transformers.cache_utils import DynamicLayer

if TYPE_CHECKING:
    import torch

SLACK = 32
"""Free columns kept after the last one: steps between two copies of the cache."""
GROWTH = 4
"""A full buffer grows by 1/GROWTH of its width (at least SLACK columns): after a long prompt joined,
a copy of the now wide cache every SLACK steps would cost more than the steps it serves."""


def spare_rows(rows: int) -> int:
    """Free rows a new buffer keeps for joiners (a quarter, at least 8)."""
    return max(8, rows // 4)


class SlackLayer(DynamicLayer):
    """One attention layer's keys and values: rows `[0, rows)`, columns `[start, end)` of a buffer."""

    keys: torch.Tensor
    values: torch.Tensor
    """Views of the buffers (DynamicLayer's may be None before its first update; these never are)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, rows: int, start: int, end: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # transformers leaves DynamicLayer.__init__ unannotated
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self._k, self._v = keys, values
        self._rows, self._start, self._end = rows, start, end
        self._view()

    @classmethod
    def stacked(cls, parts: list[tuple[torch.Tensor, torch.Tensor]], width: int) -> SlackLayer:
        """Rows of every part, each right-aligned (left-padded with zeros) to `width` columns."""
        first = parts[0][0]
        _, heads, _, dim = first.shape
        rows = sum(k.shape[0] for k, _ in parts)
        shape = (rows + spare_rows(rows), heads, width + SLACK, dim)
        k_buf, v_buf = first.new_zeros(shape), first.new_zeros(shape)
        row = 0
        for keys, values in parts:
            n, w = keys.shape[0], keys.shape[-2]
            k_buf[row : row + n, :, width - w : width] = keys
            v_buf[row : row + n, :, width - w : width] = values
            row += n
        return cls(k_buf, v_buf, rows, 0, width)

    @property
    def free_rows(self) -> int:
        return self._k.shape[0] - self._rows

    def can_widen(self, width: int) -> bool:
        """Whether `width` columns fit left of the view's end without a copy."""
        return width <= self._end

    def widen(self, width: int) -> None:
        """Show `width` columns (newly shown ones zeroed): room for a prompt longer than the view."""
        start = self._end - width
        if start < self._start:
            self._k[:, :, start : self._start].zero_()
            self._v[:, :, start : self._start].zero_()
            self._start = start
            self._view()

    def place(self, index: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write prefilled rows at row positions `index` (free rows), right-aligned to the view's end."""
        import torch

        width = self._end - self._start
        rows, heads, w, dim = keys.shape
        k_new = keys.new_zeros((rows, heads, width, dim))
        v_new = values.new_zeros((rows, heads, width, dim))
        k_new[:, :, width - w :] = keys
        v_new[:, :, width - w :] = values
        self._k[:, :, self._start : self._end].index_copy_(0, index, k_new)
        self._v[:, :, self._start : self._end].index_copy_(0, index, v_new)
        self._rows = max(self._rows, int(torch.max(index)) + 1)
        self._view()

    def trim(self, columns: int) -> None:
        """Hide the first `columns` columns (padding in every row): no copy."""
        self._start += columns
        self._view()

    def select(self, index: torch.Tensor, drop_columns: int) -> None:
        """Keep the rows in `index` (in that order), drop the first `drop_columns` columns: a copy."""
        rows = int(index.shape[0])
        start = self._start + drop_columns
        shape = (rows + spare_rows(rows), self._k.shape[1], self._end - start + SLACK, self._k.shape[3])
        k_buf, v_buf = self._k.new_zeros(shape), self._v.new_zeros(shape)
        width = self._end - start
        k_buf[:rows, :, :width] = self._k[:, :, start : self._end].index_select(0, index)
        v_buf[:rows, :, :width] = self._v[:, :, start : self._end].index_select(0, index)
        self._k, self._v, self._rows, self._start, self._end = k_buf, v_buf, rows, 0, width
        self._view()

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        new = key_states.shape[-2]
        if self._end + new > self._k.shape[-2]:
            self._regrow(new)
        self._k[: self._rows, :, self._end : self._end + new] = key_states
        self._v[: self._rows, :, self._end : self._end + new] = value_states
        self._end += new
        return self._view()

    def _regrow(self, new: int) -> None:
        width = self._end - self._start
        rows, heads, _, dim = self._k.shape
        shape = (rows, heads, width + max(SLACK, new, width // GROWTH), dim)
        k_buf, v_buf = self._k.new_zeros(shape), self._v.new_zeros(shape)
        k_buf[:, :, :width] = self._k[:, :, self._start : self._end]
        v_buf[:, :, :width] = self._v[:, :, self._start : self._end]
        self._k, self._v, self._start, self._end = k_buf, v_buf, 0, width

    def _view(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Point `keys` and `values` at the live part of the buffers; returns them."""
        keys = self.keys = self._k[: self._rows, :, self._start : self._end]
        values = self.values = self._v[: self._rows, :, self._start : self._end]
        return keys, values
