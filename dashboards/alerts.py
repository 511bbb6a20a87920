"""Grafana alert rules as code, generated from a batchtide config.

Four questions an on-call engineer wants paged on, each one rule whose SQL
returns one number per model (Grafana turns the string column into a label,
so one rule alerts per model) and a threshold expression on it:

* `slo` (one rule per model): the end-to-end p99 was above the model's
  `slo_p99_ms` in each of the last `[alerts] slo_minutes` one-minute buckets;
* `dlq`: requests went to the dead-letter topic faster than `dlq_per_s`
  (from the consumers' dead-letter counters in `consumer_lag`);
* `lag_age`: the oldest unanswered record is older than `lag_age_s`;
* `stalled`: records waited during the last `stalled_minutes` and the model
  dispatched no batch at all.

The SQL uses the ClickHouse plugin's backend macros only (alert queries have
no dashboard variables), so `pipeline.store.macros.expand_macros` runs it
exactly as Grafana would, and the tests evaluate every rule on seeded rows.
The file is written to `dashboards/provisioning/alerting/batchtide.yaml`
(Grafana file provisioning) by `batchtide dashboards generate`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from dashboards.panels import DATASOURCE_TYPE, DATASOURCE_UID, FOLDER_TITLE
from pipeline.config import Config

GROUP_NAME = "batchtide"
EVALUATE_EVERY = "1m"
EXPRESSION_UID = "__expr__"
LAG_AGE_WINDOW_S = 60
"""Lag age is judged on each partition's last sample in this window (several lag intervals)."""
DLQ_WINDOW_S = 300
SAFE_MODEL = re.compile(r"^[A-Za-z0-9._-]+$")


@dataclass(frozen=True)
class AlertRule:
    uid: str
    title: str
    sql: str
    window_s: int
    threshold: float
    summary: str
    description: str
    for_: str = "0s"
    severity: str = "page"

    def to_provisioning(self) -> dict[str, Any]:
        """The rule in Grafana's file-provisioning format: query A, threshold C on A."""
        return {
            "uid": self.uid,
            "title": self.title,
            "condition": "C",
            "data": [
                {
                    "refId": "A",
                    "relativeTimeRange": {"from": self.window_s, "to": 0},
                    "datasourceUid": DATASOURCE_UID,
                    "model": {
                        "refId": "A",
                        "datasource": {"type": DATASOURCE_TYPE, "uid": DATASOURCE_UID},
                        "editorType": "sql",
                        "format": 1,
                        "queryType": "table",
                        "rawSql": self.sql,
                    },
                },
                {
                    "refId": "C",
                    "relativeTimeRange": {"from": 0, "to": 0},
                    "datasourceUid": EXPRESSION_UID,
                    "model": {
                        "refId": "C",
                        "type": "threshold",
                        "expression": "A",
                        "datasource": {"type": EXPRESSION_UID, "uid": EXPRESSION_UID},
                        "conditions": [{"evaluator": {"type": "gt", "params": [self.threshold]}}],
                    },
                },
            ],
            "noDataState": "OK",
            "execErrState": "Error",
            "for": self.for_,
            "annotations": {"summary": self.summary, "description": self.description},
            "labels": {"severity": self.severity, "team": "batchtide"},
            "isPaused": False,
        }


def _slo_rule(model: str, slo_ms: float, minutes: int) -> AlertRule:
    return AlertRule(
        uid=f"batchtide-slo-{model}"[:40],
        title=f"{model}: p99 above its SLO for {minutes} minutes",
        sql=f"""
SELECT model, min(p99_ms) AS value
FROM (
    SELECT model, toStartOfMinute(enqueue_time) AS minute, quantileExactInclusive(0.99)(e2e_ms) AS p99_ms
    FROM request_latency FINAL
    WHERE $__timeFilter(enqueue_time) AND model = '{model}'
    GROUP BY model, minute
)
GROUP BY model
HAVING count() >= {minutes}
""".strip(),
        window_s=minutes * 60,
        threshold=float(slo_ms),
        summary=f"{model}: end-to-end p99 above {slo_ms:g} ms in each of the last {minutes} minutes",
        description=(
            "value = the lowest per-minute p99 of the window. Check the tail-latency board: wait up with "
            "it means window/cap/load, compute up means the backend (see README, How the engine batches)."
        ),
    )


def _dlq_rule(per_s: float) -> AlertRule:
    return AlertRule(
        uid="batchtide-dlq-rate",
        title="Dead letters above the rate threshold",
        sql=f"""
SELECT model, sum(grown) / {DLQ_WINDOW_S} AS value
FROM (
    SELECT model, consumer_id, max(dead_letters) - min(dead_letters) AS grown
    FROM consumer_lag
    WHERE $__timeFilter(ts)
    GROUP BY model, consumer_id
)
GROUP BY model
""".strip(),
        window_s=DLQ_WINDOW_S,
        threshold=float(per_s),
        summary=f"{{{{ $labels.model }}}}: more than {per_s:g} dead letters per second over {DLQ_WINDOW_S // 60} minutes",
        description="value = dead letters per second. Read <prefix>.dlq: each letter names its reason and keeps the original bytes.",
        severity="ticket",
    )


def _lag_age_rule(seconds: float) -> AlertRule:
    return AlertRule(
        uid="batchtide-lag-age",
        title="Oldest unanswered record too old",
        sql=f"""
SELECT model, max(age_s) AS value
FROM (
    SELECT model, topic, partition, argMax(lag_age_ms, ts) / 1000 AS age_s
    FROM consumer_lag FINAL
    WHERE $__timeFilter(ts) AND partition >= 0
    GROUP BY model, topic, partition
)
GROUP BY model
""".strip(),
        window_s=LAG_AGE_WINDOW_S,
        threshold=float(seconds),
        summary=f"{{{{ $labels.model }}}}: a record has waited more than {seconds:g} s unanswered",
        description="value = age in seconds of the oldest record not yet answered. `batchtide status` shows which partition and member.",
    )


def _stalled_rule(minutes: int) -> AlertRule:
    window = minutes * 60
    return AlertRule(
        uid="batchtide-stalled",
        title="Records waiting and no batch",
        sql=f"""
SELECT l.model AS model, if(b.batches = 0, l.waiting, 0) AS value
FROM (
    SELECT model, max(min_lag) AS waiting
    FROM (
        SELECT model, topic, partition, min(lag) AS min_lag
        FROM consumer_lag FINAL
        WHERE $__timeFilter(ts) AND partition >= 0
        GROUP BY model, topic, partition
        HAVING dateDiff('second', min(ts), max(ts)) >= {int(window * 0.8)}
    )
    GROUP BY model
) AS l
LEFT JOIN (
    SELECT model, count() AS batches
    FROM batches
    WHERE $__timeFilter(dispatch_time)
    GROUP BY model
) AS b ON b.model = l.model
""".strip(),
        window_s=window,
        threshold=0.0,
        summary=f"{{{{ $labels.model }}}}: records waited {minutes} minutes and no batch was dispatched",
        description=(
            "value = records still waiting on the least-drained partition. The consumers are members but "
            "do not serve (a stuck device, a paused loop): `batchtide status`, then restart the consumer."
        ),
    )


def alert_rules(config: Config) -> list[AlertRule]:
    """Every rule for `config`: one SLO rule per model, then the group-wide ones."""
    settings = config.alerts
    rules = []
    for name, model in sorted(config.models.items()):
        if not SAFE_MODEL.match(name):
            raise ValueError(f"model name {name!r} cannot be spliced into alert SQL (allowed: {SAFE_MODEL.pattern})")
        rules.append(_slo_rule(name, model.profile.slo_p99_ms, settings.slo_minutes))
    rules += [_dlq_rule(settings.dlq_per_s), _lag_age_rule(settings.lag_age_s), _stalled_rule(settings.stalled_minutes)]
    return rules


def provisioning(config: Config) -> dict[str, Any]:
    """The whole alerting provisioning document (apiVersion 1, one rule group)."""
    return {
        "apiVersion": 1,
        "groups": [
            {
                "orgId": 1,
                "name": GROUP_NAME,
                "folder": FOLDER_TITLE,
                "interval": EVALUATE_EVERY,
                "rules": [rule.to_provisioning() for rule in alert_rules(config)],
            }
        ],
    }
