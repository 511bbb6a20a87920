"""Grafana alert rules as code, generated from a batchtide config.

The questions an on-call engineer wants paged on, each one rule whose SQL
returns one number per model (Grafana turns the string column into a label,
so one rule alerts per model) and a threshold expression on it:

* `slo` (one rule per model): the end-to-end p99 was above the model's
  `slo_p99_ms` in each of the last `[alerts] slo_minutes` one-minute buckets;
  a request not answered `ok` (refused, expired, failed) counts as one that
  missed its objective;
* `no_consumer`: the model's group had no member while records waited, in
  every broker-side sample of the last `no_member_s` (default one minute);
* `dlq`: records reached the dead-letter topic faster than `dlq_per_s`,
  from the topic's own end offsets (all models: the topic is shared);
* `lag_age`: the oldest unanswered record is older than `lag_age_s`;
* `stalled`: the group had members, records waited during the last
  `stalled_minutes`, and the model dispatched no batch at all.

Every rule but `slo` reads the sink's broker-side samples in `consumer_lag`
(source = 'broker', pipeline/core/store/group_lag.py), which exist whether or not
any consumer runs: a consumer's own samples stop with the consumer.

The SQL uses the ClickHouse plugin's backend macros only (alert queries have
no dashboard variables), so `pipeline.core.store.macros.expand_macros` runs it
exactly as Grafana would, and the tests evaluate every rule on seeded rows.
The file is written to `dashboards/provisioning/alerting/batchtide.yaml`
(Grafana file provisioning) by `batchtide dashboards generate`, and
`batchtide dashboards push` also sends the rules through Grafana's alerting
provisioning API.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from dashboards.panels import DATASOURCE_TYPE, DATASOURCE_UID, FOLDER_TITLE, FOLDER_UID
from pipeline.core.config import Config

GROUP_NAME = "batchtide"
EVALUATE_EVERY = "1m"
EVALUATE_EVERY_S = 60
"""The same interval as Grafana's provisioning API states it (seconds)."""
ORG_ID = 1
EXPRESSION_UID = "__expr__"
LAG_AGE_WINDOW_S = 60
"""Lag age is judged on each partition's last sample in this window (several lag intervals)."""
DLQ_WINDOW_S = 300
NOT_OK_MS = 1e9
"""The end-to-end time the SLO rule gives a request not answered `ok`: later than any objective."""
BROKER_ROWS = "source = 'broker' AND model != ''"
"""The sink's broker-side samples of the models' groups (the dead-letter topic's rows have model '')."""
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

    def to_api(self) -> dict[str, Any]:
        """The rule as Grafana's alerting provisioning API takes it: the file format plus where it lives."""
        return {**self.to_provisioning(), "folderUID": FOLDER_UID, "ruleGroup": GROUP_NAME, "orgID": ORG_ID}


def _slo_rule(model: str, slo_ms: float, minutes: int) -> AlertRule:
    return AlertRule(
        uid=f"batchtide-slo-{model}"[:40],
        title=f"{model}: p99 above its SLO for {minutes} minutes",
        sql=f"""
SELECT model, min(p99_ms) AS value
FROM (
    SELECT model, toStartOfMinute(enqueue_time) AS minute,
           quantileExactInclusive(0.99)(if(outcome = 'ok', e2e_ms, {NOT_OK_MS:g})) AS p99_ms
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
            "value = the lowest per-minute p99 of the window; a request refused, expired or failed counts as "
            f"{NOT_OK_MS:g} ms (over any objective), so 1% of them in every minute fires it too. Check the "
            "tail-latency board: wait up with it means window/cap/load, compute up means the backend (see docs/engine.md, "
            "One poll); refusals and errors by reason are in `batchtide report`."
        ),
    )


def _dlq_rule(per_s: float) -> AlertRule:
    return AlertRule(
        uid="batchtide-dlq-rate",
        title="Dead letters above the rate threshold",
        sql=f"""
SELECT 'all models' AS model, sum(grown) / {DLQ_WINDOW_S} AS value
FROM (
    SELECT topic, partition, max(end_offset) - min(end_offset) AS grown
    FROM consumer_lag
    WHERE $__timeFilter(ts) AND source = 'broker' AND model = ''
    GROUP BY topic, partition
)
""".strip(),
        window_s=DLQ_WINDOW_S,
        threshold=float(per_s),
        summary=f"more than {per_s:g} dead letters per second over {DLQ_WINDOW_S // 60} minutes",
        description=(
            "value = records per second appended to <prefix>.dlq (its end offsets, sampled by the sink; with "
            "transactional consumers each transaction's commit marker counts too). Read the topic: each letter "
            "names its reason and keeps the original bytes; `batchtide report` counts refusals by reason."
        ),
        severity="ticket",
    )


def _no_consumer_rule(seconds: float, sample_interval_s: float) -> AlertRule:
    window = max(round(seconds), 1)
    cover_ms = int(max(window - 2 * sample_interval_s, window / 2) * 1000)
    return AlertRule(
        uid="batchtide-no-consumer",
        title="Records waiting and no consumer in the group",
        sql=f"""
SELECT model,
       if(max(members) = 0 AND min(waiting) > 0 AND dateDiff('millisecond', min(ts), max(ts)) >= {cover_ms},
          min(waiting), 0) AS value
FROM (
    SELECT model, ts, max(members) AS members, sum(lag) AS waiting
    FROM consumer_lag
    WHERE $__timeFilter(ts) AND {BROKER_ROWS}
    GROUP BY model, ts
)
GROUP BY model
""".strip(),
        window_s=window,
        threshold=0.0,
        summary=f"{{{{ $labels.model }}}}: records waited {window} s and no consumer is in the model's group",
        description=(
            "value = the fewest records waiting in any sample of the window, every sample of which had no member. "
            "Every consumer of the model is gone (crashed, evicted, scaled to zero): nobody answers. Start one: "
            "`batchtide consume --model M --config F`; `batchtide status` shows the group."
        ),
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
    WHERE $__timeFilter(ts) AND {BROKER_ROWS} AND partition >= 0
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
        WHERE $__timeFilter(ts) AND {BROKER_ROWS} AND members > 0 AND partition >= 0
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
    rules += [
        _no_consumer_rule(settings.no_member_s, config.clickhouse.group_lag_interval_ms / 1000),
        _dlq_rule(settings.dlq_per_s),
        _lag_age_rule(settings.lag_age_s),
        _stalled_rule(settings.stalled_minutes),
    ]
    return rules


def provisioning(config: Config) -> dict[str, Any]:
    """The whole alerting provisioning document (apiVersion 1, one rule group)."""
    return {
        "apiVersion": 1,
        "groups": [
            {
                "orgId": ORG_ID,
                "name": GROUP_NAME,
                "folder": FOLDER_TITLE,
                "interval": EVALUATE_EVERY,
                "rules": [rule.to_provisioning() for rule in alert_rules(config)],
            }
        ],
    }
