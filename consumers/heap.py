"""Keeping the cyclic garbage collector off the hot path of a long-running process."""

from __future__ import annotations

import gc


def freeze_heap() -> None:
    """Move everything loaded so far (torch, transformers, the model, the Kafka clients) out
    of the cyclic collector's reach. Otherwise its full passes walk millions of startup
    objects and stall the process for tens of ms, most often in the first seconds of load
    (measured: the first 5 s of a 120 req/s MiniLM run had p99 71-83 ms without, 53 with)."""
    gc.collect()
    gc.freeze()
