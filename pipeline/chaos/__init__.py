"""Fault injection against the real pipeline: scenarios, the harness that runs them, the ledger of lost and duplicated requests."""
