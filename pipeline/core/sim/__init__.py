"""The simulated policy bench: scenarios, a discrete-event simulator driving any BatchPolicy
with a virtual clock, peer policies, capacity-at-SLO search and reports; and a consumer group
with its devices and forwarding for `bench fleet` (docs/benchmarks.md)."""
