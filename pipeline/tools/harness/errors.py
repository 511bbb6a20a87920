"""The one error the harness raises for itself."""

from __future__ import annotations


class HarnessError(RuntimeError):
    """The harness could not set up or drive a run (not a verdict on the pipeline)."""
