"""Benchmarks, above what they measure: the policy bench (simulated), the pipeline, intake and store benches (real)."""
