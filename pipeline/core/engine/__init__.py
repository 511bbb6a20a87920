"""The pure batching policy (docs/engine.md): no clock, no I/O, no asyncio."""

from pipeline.core.engine.decisions import (
    Batch,
    BatchPolicy,
    Decision,
    DispatchReason,
    DispatchRecord,
    LearnedCost,
    PendingRequest,
    ServingPolicy,
)
from pipeline.core.engine.engine import BatchingEngine

__all__ = [
    "Batch",
    "BatchPolicy",
    "BatchingEngine",
    "Decision",
    "DispatchReason",
    "DispatchRecord",
    "LearnedCost",
    "PendingRequest",
    "ServingPolicy",
]
