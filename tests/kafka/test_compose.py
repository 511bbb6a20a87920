"""docker-compose.yml cannot run here (no Docker engine); check what can be checked offline:
it parses, and its services, ports, paths and env agree with the code's defaults."""

from __future__ import annotations

import base64
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipeline.core.config import KafkaSettings, load_config
from pipeline.tools.devtools.localkafka import KAFKA_VERSION

ROOT = Path(__file__).resolve().parents[2]
CLICKHOUSE_HTTP_PORT = 8123
GRAFANA_PORT = 3000


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert isinstance(data, dict)
    return data


def _service(compose: dict[str, Any], name: str) -> dict[str, Any]:
    return compose["services"][name]


def _published(service: dict[str, Any]) -> dict[int, int]:
    """{host port: container port} from "ip:host:container" or "host:container" entries."""
    ports: dict[int, int] = {}
    for entry in service.get("ports", []):
        *_, host, container = str(entry).split(":")
        ports[int(host)] = int(container)
    return ports


def _listeners(value: str) -> dict[str, tuple[str, int]]:
    out = {}
    for item in value.split(","):
        name, address = item.split("://")
        host, port = address.rsplit(":", 1)
        out[name] = (host, int(port))
    return out


def test_services_are_the_documented_stack(compose: dict[str, Any]) -> None:
    assert set(compose["services"]) == {"kafka", "clickhouse", "grafana", "topics", "consumer", "sink"}
    assert _service(compose, "kafka")["image"] == f"apache/kafka:{KAFKA_VERSION}"
    assert _service(compose, "clickhouse")["image"].startswith("clickhouse/clickhouse-server:")
    assert _service(compose, "grafana")["image"].startswith("grafana/grafana:")


def test_kafka_kraft_settings_are_consistent_with_the_client_default(compose: dict[str, Any]) -> None:
    env = _service(compose, "kafka")["environment"]
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert len(base64.urlsafe_b64decode(env["CLUSTER_ID"] + "==")) == 16, "CLUSTER_ID must be a Kafka UUID"
    listeners = _listeners(env["KAFKA_LISTENERS"])
    advertised = _listeners(env["KAFKA_ADVERTISED_LISTENERS"])
    protocols = dict(item.split(":") for item in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(","))
    assert set(listeners) <= set(protocols)
    assert set(advertised) <= set(listeners) - {env["KAFKA_CONTROLLER_LISTENER_NAMES"]}
    assert env["KAFKA_INTER_BROKER_LISTENER_NAME"] in advertised
    voter_id, voter = env["KAFKA_CONTROLLER_QUORUM_VOTERS"].split("@")
    assert int(voter_id) == int(env["KAFKA_NODE_ID"])
    assert int(voter.rsplit(":", 1)[1]) == listeners[env["KAFKA_CONTROLLER_LISTENER_NAMES"]][1]
    assert str(env["KAFKA_AUTO_CREATE_TOPICS_ENABLE"]) == "false", "topics are created by `batchtide topics create`"

    default_host, default_port = KafkaSettings().bootstrap_servers.split(",")[0].rsplit(":", 1)
    host_listener = [name for name, (host, port) in advertised.items() if port == int(default_port)]
    assert host_listener, "the code's default bootstrap port must be advertised for host clients"
    assert advertised[host_listener[0]][0] == default_host
    assert _published(_service(compose, "kafka"))[int(default_port)] == listeners[host_listener[0]][1]

    internal = compose["x-batchtide-env"]["BATCHTIDE_KAFKA_BOOTSTRAP"]
    host, port = internal.rsplit(":", 1)
    assert host in compose["services"] and (host, int(port)) in advertised.values()


def test_clickhouse_and_the_sink_agree_on_the_http_port(compose: dict[str, Any]) -> None:
    assert _published(_service(compose, "clickhouse"))[CLICKHOUSE_HTTP_PORT] == CLICKHOUSE_HTTP_PORT
    command = _service(compose, "sink")["command"]
    url = command[command.index("--clickhouse-url") + 1]
    assert url == f"http://clickhouse:{CLICKHOUSE_HTTP_PORT}"


def test_grafana_provisioning_paths_and_variables_match_the_files(compose: dict[str, Any]) -> None:
    grafana = _service(compose, "grafana")
    env = grafana["environment"]
    assert _published(grafana)[GRAFANA_PORT] == GRAFANA_PORT
    assert "grafana-clickhouse-datasource" in env["GF_INSTALL_PLUGINS"].split(",")
    mounts = {}
    for volume in grafana["volumes"]:
        source, target, *_ = volume.split(":")
        mounts[target] = source
    provisioning = ROOT / mounts["/etc/grafana/provisioning"]
    assert provisioning.resolve() == (ROOT / "dashboards" / "provisioning").resolve()

    providers = yaml.safe_load(next((provisioning / "dashboards").glob("*.yaml")).read_text())["providers"]
    for provider in providers:
        target = provider["options"]["path"]
        assert target in mounts, f"dashboard provider path {target} is not mounted"
        assert list((ROOT / mounts[target]).glob("*.json")), "the mounted dashboards dir holds dashboards"

    datasources_file = next((provisioning / "datasources").glob("*.yaml"))
    datasources = yaml.safe_load(datasources_file.read_text())["datasources"]
    assert {d["type"] for d in datasources} == {"grafana-clickhouse-datasource"}
    wanted = set(re.findall(r"\$\{?([A-Z_][A-Z0-9_]*)", yaml.safe_dump(datasources)))
    assert wanted and wanted <= set(env), f"unset in grafana env: {wanted - set(env)}"
    assert env["BATCHTIDE_CLICKHOUSE_HOST"] in compose["services"]
    assert int(env["BATCHTIDE_CLICKHOUSE_PORT"]) == CLICKHOUSE_HTTP_PORT


def test_consumer_runs_a_configured_model_from_the_image(compose: dict[str, Any]) -> None:
    command = _service(compose, "consumer")["command"]
    assert command[:2] == ["batchtide", "consume"]
    model = command[command.index("--model") + 1]
    config_path = command[command.index("--config") + 1]
    assert model in load_config(ROOT / "batchtide.toml").models
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim$", dockerfile, re.MULTILINE)
    assert f"COPY batchtide.toml {config_path}" in dockerfile
    assert re.search(r"pip install .* \.", dockerfile)
    assert _service(compose, "topics")["build"] == "."


def test_no_secret_is_written_into_the_file(compose: dict[str, Any]) -> None:
    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if "PASSWORD" in str(key):
                    assert re.fullmatch(r"\$\{[A-Z_]+(:\?[^}]*)?\}", str(value)), f"{path}.{key} must come from env"
                walk(value, f"{path}.{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{path}[{i}]")

    walk(compose, "compose")
