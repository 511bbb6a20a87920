"""Fault injection against the real pipeline, every request accounted for.

`harness` deploys the pipeline (real broker, real consumer and sink processes)
and drives traffic; `ledger` counts what was lost and duplicated; one module
per fault (`consumer_kill`, `broker_restart`, `clickhouse_outage`, `sink_kill`,
`poison`, `overload`, `rebalance_storm`, `hostile_input`); `catalogue` lists them for `batchtide chaos`.
"""
