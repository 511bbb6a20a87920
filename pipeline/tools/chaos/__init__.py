"""Fault injection against the real pipeline: real broker, real processes, really killed.

The same scenarios serve both the `tests/faults/` suite and `batchtide chaos`,
so the table a person reads and the assertions CI makes come from the same run
of the same code. A scenario deploys consumers and the sink as processes
(`deployment`, on the shared end-to-end harness `pipeline.tools.harness`), drives
open-loop traffic with known request ids, injects its fault (SIGKILL, broker
stop, ClickHouse outage, poison input, overload, group churn) and accounts for
every id in the `ledger`:

- *lost*: sent, never answered (no Result and no dead letter);
- *duplicated*: extra Results for an id already answered (at-least-once);
- *recovery*: seconds from the end of the fault until every request sent
  before that moment was answered (for the ClickHouse faults: until every
  latency event is a ClickHouse row).

A scenario never decides success by itself being quiet: it returns a
`FaultReport` whose `failures` list names every broken promise. `steps` holds
the sizes and the closing steps every scenario shares; one module per fault
(`consumer_kill`, `broker_restart`, `clickhouse_outage`, `sink_kill`, `poison`,
`overload`, `rebalance_storm`, `hostile_input`, and the three-broker rows in
`cluster_faults` and `leader_kill` over `cluster_load` and `cluster_look`); `catalogue`
lists them for `batchtide chaos`.
"""
