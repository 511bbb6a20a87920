"""Push the ClickHouse datasource, the batchtide folder, the boards and the alert rules to a Grafana server.

For Grafana instances that are not provisioned from files (a shared or hosted
Grafana). Every object is read first and written only when it differs from
what we would write, so a second push issues no write call at all and leaves
dashboard versions alone. The alert rules go through Grafana's alerting
provisioning API (`/api/v1/provisioning/alert-rules`, one rule group in the
batchtide folder), the same rules the file provisioning carries; a rule of
that group that the config no longer generates (a model removed) is deleted.
Credentials come from the environment and are never printed.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlparse

from grafana_client import GrafanaApi
from grafana_client.client import GrafanaClientError

from dashboards.alerts import EVALUATE_EVERY_S, GROUP_NAME, AlertRule
from dashboards.panels import (
    DATASOURCE_NAME,
    DATASOURCE_TYPE,
    DATASOURCE_UID,
    FOLDER_TITLE,
    FOLDER_UID,
)

Outcome = Literal["created", "updated", "unchanged", "deleted"]
COMMIT_MESSAGE = "batchtide dashboards push"


class GrafanaAuthMissing(RuntimeError):
    """Neither GRAFANA_TOKEN nor GRAFANA_USER/GRAFANA_PASSWORD is set."""


@dataclass(frozen=True)
class ClickHouseTarget:
    """The ClickHouse server as Grafana will reach it (not necessarily as we do)."""

    host: str
    port: int
    protocol: Literal["http", "native"]
    secure: bool
    username: str
    database: str
    password: str | None = None

    @classmethod
    def from_url(cls, url: str, database: str) -> ClickHouseTarget:
        """http(s)://host:port for the HTTP interface, clickhouse(s)://host:port for native."""
        parsed = urlparse(url)
        scheme = parsed.scheme.lower()
        if scheme not in ("http", "https", "clickhouse", "clickhouses") or not parsed.hostname:
            raise ValueError(f"ClickHouse URL {url!r} must look like http://host:8123 or clickhouse://host:9000")
        secure = scheme in ("https", "clickhouses")
        protocol: Literal["http", "native"] = "http" if scheme.startswith("http") else "native"
        default_port = {("http", False): 8123, ("http", True): 8443, ("native", False): 9000, ("native", True): 9440}
        return cls(
            host=parsed.hostname,
            port=parsed.port or default_port[(protocol, secure)],
            protocol=protocol,
            secure=secure,
            username=os.environ.get("BATCHTIDE_CLICKHOUSE_USER") or parsed.username or "default",
            database=database,
            password=os.environ.get("BATCHTIDE_CLICKHOUSE_PASSWORD") or None,
        )


@dataclass(frozen=True)
class PushResult:
    kind: Literal["datasource", "folder", "dashboard", "alert-rule", "rule-group"]
    uid: str
    outcome: Outcome


def grafana_credential() -> str | tuple[str, str]:
    """A bearer token (GRAFANA_TOKEN) or basic auth (GRAFANA_USER + GRAFANA_PASSWORD)."""
    token = os.environ.get("GRAFANA_TOKEN")
    if token:
        return token
    user, password = os.environ.get("GRAFANA_USER"), os.environ.get("GRAFANA_PASSWORD")
    if user and password:
        return (user, password)
    raise GrafanaAuthMissing("set GRAFANA_TOKEN (service account token) or GRAFANA_USER and GRAFANA_PASSWORD")


def connect(grafana_url: str, timeout_s: float = 10.0) -> GrafanaApi:
    api: GrafanaApi = GrafanaApi.from_url(grafana_url, credential=grafana_credential(), timeout=timeout_s)
    return api


def datasource_body(target: ClickHouseTarget) -> dict[str, Any]:
    """The datasource as the ClickHouse plugin stores it (secure part excluded)."""
    return {
        "uid": DATASOURCE_UID,
        "name": DATASOURCE_NAME,
        "type": DATASOURCE_TYPE,
        "access": "proxy",
        "isDefault": False,
        "jsonData": {
            "host": target.host,
            "port": target.port,
            "protocol": target.protocol,
            "secure": target.secure,
            "username": target.username,
            "defaultDatabase": target.database,
        },
    }


def _get_or_none(read: Callable[[], Any]) -> Any:
    try:
        return read()
    except GrafanaClientError as error:
        if error.status_code == 404:
            return None
        raise


def _datasource_differs(current: dict[str, Any], wanted: dict[str, Any], has_password: bool) -> bool:
    for key in ("name", "type", "access", "isDefault"):
        if current.get(key) != wanted[key]:
            return True
    current_json = current.get("jsonData") or {}
    if any(current_json.get(k) != v for k, v in wanted["jsonData"].items()):
        return True
    password_stored = bool((current.get("secureJsonFields") or {}).get("password"))
    return has_password and not password_stored


def push_datasource(api: GrafanaApi, target: ClickHouseTarget) -> PushResult:
    wanted = datasource_body(target)
    secure = {"secureJsonData": {"password": target.password}} if target.password else {}
    current = _get_or_none(lambda: api.datasource.get_datasource_by_uid(DATASOURCE_UID))
    if current is None:
        api.datasource.create_datasource({**wanted, **secure})
        return PushResult("datasource", DATASOURCE_UID, "created")
    if not _datasource_differs(current, wanted, target.password is not None):
        return PushResult("datasource", DATASOURCE_UID, "unchanged")
    api.datasource.update_datasource_by_uid(DATASOURCE_UID, {**wanted, **secure})
    return PushResult("datasource", DATASOURCE_UID, "updated")


def push_folder(api: GrafanaApi) -> PushResult:
    current = _get_or_none(lambda: api.folder.get_folder(FOLDER_UID))
    if current is None:
        api.folder.create_folder(FOLDER_TITLE, uid=FOLDER_UID)
        return PushResult("folder", FOLDER_UID, "created")
    if current.get("title") == FOLDER_TITLE:
        return PushResult("folder", FOLDER_UID, "unchanged")
    api.folder.update_folder(FOLDER_UID, title=FOLDER_TITLE, version=current.get("version"), overwrite=True)
    return PushResult("folder", FOLDER_UID, "updated")


def _comparable(model: dict[str, Any]) -> dict[str, Any]:
    """A dashboard without the fields Grafana owns (id, version)."""
    return {k: v for k, v in model.items() if k not in ("id", "version")}


def push_dashboard(api: GrafanaApi, model: dict[str, Any]) -> PushResult:
    uid = str(model["uid"])
    current = _get_or_none(lambda: api.dashboard.get_dashboard(uid))
    if current is not None:
        same_model = _comparable(current.get("dashboard") or {}) == _comparable(model)
        same_folder = (current.get("meta") or {}).get("folderUid") == FOLDER_UID
        if same_model and same_folder:
            return PushResult("dashboard", uid, "unchanged")
    api.dashboard.update_dashboard(
        {
            "dashboard": {**_comparable(model), "id": None},
            "folderUid": FOLDER_UID,
            "overwrite": current is not None,
            "message": COMMIT_MESSAGE,
        }
    )
    return PushResult("dashboard", uid, "created" if current is None else "updated")


def _rule_differs(current: dict[str, Any], wanted: dict[str, Any]) -> bool:
    """Only the fields we send count: Grafana adds its own (id, updated, provenance)."""
    return any(current.get(key) != value for key, value in wanted.items())


def push_alert_rule(api: GrafanaApi, rule: AlertRule) -> PushResult:
    wanted = rule.to_api()
    provisioning = api.alertingprovisioning
    current = _get_or_none(lambda: provisioning.get_alertrule(rule.uid))
    if current is None:
        provisioning.create_alertrule(wanted)
        return PushResult("alert-rule", rule.uid, "created")
    if not _rule_differs(current, wanted):
        return PushResult("alert-rule", rule.uid, "unchanged")
    provisioning.update_alertrule(rule.uid, wanted)
    return PushResult("alert-rule", rule.uid, "updated")


def push_rule_group(api: GrafanaApi, rules: list[AlertRule]) -> list[PushResult]:
    """After the rules: the group evaluates every minute, and holds no rule we no longer generate."""
    provisioning = api.alertingprovisioning
    group = _get_or_none(lambda: provisioning.get_rule_group(FOLDER_UID, GROUP_NAME))
    if group is None:
        return []
    wanted = {rule.uid for rule in rules}
    results = []
    for stale in [r for r in group.get("rules") or [] if r.get("uid") not in wanted]:
        provisioning.delete_alertrule(stale["uid"])
        results.append(PushResult("alert-rule", str(stale["uid"]), "deleted"))
    if group.get("interval") == EVALUATE_EVERY_S:
        return [*results, PushResult("rule-group", GROUP_NAME, "unchanged")]
    kept = [r for r in group.get("rules") or [] if r.get("uid") in wanted]
    provisioning.update_rule_group(
        FOLDER_UID,
        GROUP_NAME,
        {"title": GROUP_NAME, "folderUid": FOLDER_UID, "interval": EVALUATE_EVERY_S, "rules": kept},
    )
    return [*results, PushResult("rule-group", GROUP_NAME, "updated")]


def push_all(
    api: GrafanaApi, target: ClickHouseTarget, boards: list[dict[str, Any]], rules: list[AlertRule] | None = None
) -> list[PushResult]:
    """Datasource first (panels and rules reference it by uid), then the folder, each board, each alert rule."""
    results = [push_datasource(api, target), push_folder(api)]
    results += [push_dashboard(api, model) for model in boards]
    if rules:
        results += [push_alert_rule(api, rule) for rule in rules]
        results += push_rule_group(api, rules)
    return results
