"""A small Grafana HTTP API on 127.0.0.1 that keeps state and records every request.

It answers the endpoints `batchtide dashboards push` uses the way Grafana does
(404 for unknown uids, ids and versions assigned on save, secure fields hidden
on read; alert rules of the provisioning API get an id, provenance and update
time, and join their rule group, which a new group starts at Grafana's 60 s
default and a group PUT replaces whole), so the push code talks to it over real
HTTP through grafana-client.
"""

from __future__ import annotations

import copy
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class RecordedRequest:
    method: str
    path: str
    body: Any
    authorization: str | None


@dataclass
class GrafanaState:
    datasources: dict[str, dict[str, Any]] = field(default_factory=dict)
    folders: dict[str, dict[str, Any]] = field(default_factory=dict)
    dashboards: dict[str, dict[str, Any]] = field(default_factory=dict)
    alert_rules: dict[str, dict[str, Any]] = field(default_factory=dict)
    rule_groups: dict[tuple[str, str], int] = field(default_factory=dict)
    """(folder uid, group title) -> evaluation interval in seconds."""
    requests: list[RecordedRequest] = field(default_factory=list)
    next_id: int = 1

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id


class _Handler(BaseHTTPRequestHandler):
    state: GrafanaState
    lock: threading.Lock

    def log_message(self, format: str, *args: Any) -> None:
        return

    def _reply(self, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode() if status != 204 else b""
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _handle(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        path = self.path.split("?", 1)[0]
        with self.lock:
            self.state.requests.append(RecordedRequest(self.command, path, body, self.headers.get("Authorization")))
            status, payload = self._route(self.command, path, body)
        self._reply(status, payload)

    do_GET = do_POST = do_PUT = do_DELETE = _handle

    def _route(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        s = self.state
        if not (self.headers.get("Authorization") or "").strip():
            return 401, {"message": "Unauthorized"}
        if m := re.fullmatch(r"/api/datasources/uid/([^/]+)", path):
            uid = m.group(1)
            if method == "GET":
                if uid not in s.datasources:
                    return 404, {"message": "Data source not found"}
                stored = copy.deepcopy(s.datasources[uid])
                secure = stored.pop("secureJsonData", {}) or {}
                stored["secureJsonFields"] = dict.fromkeys(secure, True)
                return 200, stored
            if method == "PUT":
                if uid not in s.datasources:
                    return 404, {"message": "Data source not found"}
                old = s.datasources[uid]
                merged = {**body, "id": old["id"], "version": old["version"] + 1}
                merged["secureJsonData"] = {**(old.get("secureJsonData") or {}), **(body.get("secureJsonData") or {})}
                s.datasources[uid] = merged
                return 200, {"message": "Datasource updated", "id": old["id"]}
        if path == "/api/datasources" and method == "POST":
            uid = body["uid"]
            if uid in s.datasources:
                return 409, {"message": "data source with the same uid already exists"}
            s.datasources[uid] = {**body, "id": s.new_id(), "version": 1}
            return 200, {"message": "Datasource added", "id": s.datasources[uid]["id"]}
        if m := re.fullmatch(r"/api/folders/([^/]+)", path):
            uid = m.group(1)
            if uid not in s.folders:
                return 404, {"message": "folder not found"}
            if method == "GET":
                return 200, s.folders[uid]
            if method == "PUT":
                s.folders[uid] = {**s.folders[uid], "title": body["title"], "version": s.folders[uid]["version"] + 1}
                return 200, s.folders[uid]
        if path == "/api/folders" and method == "POST":
            uid = body["uid"]
            if uid in s.folders:
                return 409, {"message": "a folder with the same uid already exists"}
            s.folders[uid] = {"uid": uid, "title": body["title"], "id": s.new_id(), "version": 1}
            return 200, s.folders[uid]
        if m := re.fullmatch(r"/api/dashboards/uid/([^/]+)", path):
            uid = m.group(1)
            if uid not in s.dashboards:
                return 404, {"message": "Dashboard not found"}
            return 200, copy.deepcopy(s.dashboards[uid])
        if path == "/api/dashboards/db" and method == "POST":
            model = body["dashboard"]
            uid = model["uid"]
            existing = s.dashboards.get(uid)
            if existing is not None and not body.get("overwrite"):
                return 412, {"message": "A dashboard with the same uid already exists", "status": "name-exists"}
            version = existing["dashboard"]["version"] + 1 if existing else 1
            dash_id = existing["dashboard"]["id"] if existing else s.new_id()
            stored = {**model, "id": dash_id, "version": version}
            s.dashboards[uid] = {"dashboard": stored, "meta": {"folderUid": body.get("folderUid", "")}}
            return 200, {"id": dash_id, "uid": uid, "version": version, "status": "success"}
        if path.startswith("/api/v1/provisioning/"):
            return self._provisioning(method, path.removeprefix("/api/v1/provisioning"), body)
        return 404, {"message": f"no route {method} {path}"}

    def _provisioning(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        s = self.state
        if path == "/alert-rules" and method == "POST":
            if body["uid"] in s.alert_rules:
                return 409, {"message": "a rule with this uid already exists"}
            if body.get("folderUID") not in s.folders:
                return 400, {"message": "folder does not exist"}
            s.rule_groups.setdefault((body["folderUID"], body["ruleGroup"]), 60)
            s.alert_rules[body["uid"]] = {**body, "id": s.new_id(), "provenance": "api", "updated": "now"}
            return 201, s.alert_rules[body["uid"]]
        if m := re.fullmatch(r"/alert-rules/([^/]+)", path):
            uid = m.group(1)
            if uid not in s.alert_rules:
                return 404, {"message": "rule not found"} if method != "DELETE" else {}
            if method == "GET":
                return 200, copy.deepcopy(s.alert_rules[uid])
            if method == "PUT":
                s.alert_rules[uid] = {**body, "id": s.alert_rules[uid]["id"], "provenance": "api", "updated": "later"}
                return 200, s.alert_rules[uid]
            if method == "DELETE":
                del s.alert_rules[uid]
                return 204, {}
        if m := re.fullmatch(r"/folder/([^/]+)/rule-groups/([^/]+)", path):
            key = (m.group(1), m.group(2))
            members = [r for r in s.alert_rules.values() if (r["folderUID"], r["ruleGroup"]) == key]
            if method == "GET":
                if key not in s.rule_groups or not members:
                    return 404, {"message": "rule group not found"}
                return 200, {"title": key[1], "folderUid": key[0], "interval": s.rule_groups[key],
                             "rules": copy.deepcopy(members)}  # fmt: skip
            if method == "PUT":
                kept = {r["uid"] for r in body.get("rules") or []}
                for rule in members:
                    if rule["uid"] not in kept:
                        del s.alert_rules[rule["uid"]]
                s.rule_groups[key] = int(body["interval"])
                return 200, body
        return 404, {"message": f"no provisioning route {method} {path}"}


class FakeGrafana:
    """Runs the API in a daemon thread; `url` is where grafana-client should point."""

    def __init__(self) -> None:
        self.state = GrafanaState()
        handler = type("Handler", (_Handler,), {"state": self.state, "lock": threading.Lock()})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_port}"

    def __enter__(self) -> FakeGrafana:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def calls(self) -> list[tuple[str, str]]:
        return [(r.method, r.path) for r in self.state.requests]

    def writes(self) -> list[tuple[str, str]]:
        return [(m, p) for m, p in self.calls() if m != "GET"]

    def clear(self) -> None:
        self.state.requests.clear()
