"""KV cache layers with room to grow: a decode step writes its column in place.

transformers' `DynamicLayer` appends every step's keys and values with
`torch.cat`, which copies the layer's whole cache each step. With a running
set that copy grows with rows x width and came to dominate the step: 128 rows
at ~160 cached tokens took 644 ms per step against 399 ms at 40 tokens
(SmolLM2-135M, one CPU thread), and `aten::cat` was ~70% of a step's CPU in
torch's profiler. A `SlackLayer` holds a buffer with `SLACK` free columns
and hands attention a view: the cache is copied once per `SLACK` steps, at a
join (rows are stacked) and at a compaction (rows leave), not every step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from transformers.cache_utils import DynamicLayer

if TYPE_CHECKING:
    import torch

SLACK = 32
"""Free columns kept after the last one: steps between two copies of the cache."""


class SlackLayer(DynamicLayer):
    """One attention layer's keys and values: a view `[start, end)` of a larger buffer."""

    def __init__(self, keys: "torch.Tensor", values: "torch.Tensor", start: int, end: int) -> None:
        super().__init__()
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self._k, self._v = keys, values
        self._start, self._end = start, end
        self._view()

    @classmethod
    def stacked(cls, parts: list[tuple["torch.Tensor", "torch.Tensor"]], width: int) -> "SlackLayer":
        """Rows of every part, each right-aligned (left-padded with zeros) to `width` columns."""
        first = parts[0][0]
        batch, heads, _, dim = first.shape
        rows = sum(k.shape[0] for k, _ in parts)
        k_buf = first.new_zeros((rows, heads, width + SLACK, dim))
        v_buf = first.new_zeros((rows, heads, width + SLACK, dim))
        row = 0
        for keys, values in parts:
            n, w = keys.shape[0], keys.shape[-2]
            k_buf[row : row + n, :, width - w : width] = keys
            v_buf[row : row + n, :, width - w : width] = values
            row += n
        return cls(k_buf, v_buf, 0, width)

    def select(self, index: "torch.Tensor", drop_columns: int) -> None:
        """Keep the rows in `index` (in that order) and drop the first `drop_columns` columns."""
        self._k = self._k.index_select(0, index)
        self._v = self._v.index_select(0, index)
        self._start += drop_columns
        self._view()

    def update(self, key_states: "torch.Tensor", value_states: "torch.Tensor", *args: object, **kwargs: object) -> tuple["torch.Tensor", "torch.Tensor"]:
        new = key_states.shape[-2]
        if self._end + new > self._k.shape[-2]:
            self._regrow(new)
        self._k[:, :, self._end : self._end + new] = key_states
        self._v[:, :, self._end : self._end + new] = value_states
        self._end += new
        self._view()
        return self.keys, self.values

    def _regrow(self, new: int) -> None:
        width = self._end - self._start
        batch, heads, _, dim = self._k.shape
        k_buf = self._k.new_empty((batch, heads, width + max(SLACK, new), dim))
        v_buf = self._v.new_empty((batch, heads, width + max(SLACK, new), dim))
        k_buf[:, :, :width] = self.keys
        v_buf[:, :, :width] = self.values
        self._k, self._v, self._start, self._end = k_buf, v_buf, 0, width

    def _view(self) -> None:
        self.keys = self._k[:, :, self._start : self._end]
        self.values = self._v[:, :, self._start : self._end]
