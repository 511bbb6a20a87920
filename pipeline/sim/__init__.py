"""The simulated policy bench: scenarios, a discrete-event simulator driving any BatchPolicy
with a virtual clock, peer policies, capacity-at-SLO search and reports (docs/benchmarks.md)."""
