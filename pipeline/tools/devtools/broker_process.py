"""The broker as a process on this machine: loopback ports, its pid, and the lifeline that ends it.

What `LocalKafka` needs from the operating system, apart from Kafka: a free
loopback port, whether a recorded pid is still our broker, waiting for it to
exit, and `LIFELINE`, which makes a broker end with the process that started
it, however that process ends.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def free_port() -> int:
    """An unused TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_is_free(port: int) -> bool:
    """Whether a server could listen on the loopback port now.

    SO_REUSEADDR as the JVM sets it: connections of a stopped broker lingering
    in TIME_WAIT must not block its restart on the same port.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def is_our_broker(pid: int, data_dir: Path) -> bool:
    """A recorded pid is only trusted while it still runs Kafka on this data dir."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return str(data_dir / "server.properties").encode() in cmdline


def run_sync(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion from sync code, even inside a running event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return True


LIFELINE = 'exec 3<&0; (cat <&3 >/dev/null; kill -TERM 0) & exec 3<&- "$@"'
"""Runs the broker with a watcher in its process group that reads the broker's
stdin, a pipe whose write end only the starting process holds. When that
process ends, however it ends (SIGKILL included, from any thread), the pipe
closes and the watcher sends SIGTERM to the group. `setpriv --pdeathsig`
would not do: it fires when the starting thread ends, and brokers are often
started from a worker thread (asyncio.to_thread)."""


def wait_exit(pid: int, process: subprocess.Popen[bytes] | None, timeout_s: float) -> bool:
    """Whether `pid` (our child `process` when it is that pid) exited within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.pid == pid:
            if process.poll() is not None:
                return True
        elif not pid_alive(pid):
            return True
        time.sleep(0.05)
    return False


async def metadata_probe(
    bootstrap: str, node_id: int, budget_s: float, *, security: str, ca_file: Path | None, sasl_users: dict[str, str]
) -> None:
    """Succeeds once the broker answers metadata and lists node `node_id` as alive (unfenced)."""
    from aiokafka import AIOKafkaClient

    from pipeline.core.kafka.client import REDACTOR
    from pipeline.tools.devtools.kafka_jars import KafkaSetupError

    options: dict[str, object] = {
        "bootstrap_servers": bootstrap,
        "request_timeout_ms": 5000,
        "security_protocol": security,
    }
    if ca_file is not None:
        from aiokafka.helpers import create_ssl_context

        options["ssl_context"] = create_ssl_context(cafile=ca_file)
    if sasl_users:
        user, password = next(iter(sorted(sasl_users.items())))
        REDACTOR.add(password)
        options |= {"sasl_mechanism": "PLAIN", "sasl_plain_username": user, "sasl_plain_password": password}
    client = AIOKafkaClient(**options)
    try:
        await asyncio.wait_for(client.bootstrap(), timeout=max(budget_s, 0.5))
        if client.cluster.broker_metadata(node_id) is None:
            raise KafkaSetupError(f"metadata does not list node {node_id} as a live broker yet")
    finally:
        await client.close()


def restart_in_background(
    take_down: Callable[[], None], start: Callable[[], None], seconds: float, name: str
) -> concurrent.futures.Future[float]:
    """`take_down()` now, then `start()` in a thread once `seconds` have passed since; the future
    resolves to the downtime measured (down until started again), or raises what the start raised."""
    outage: concurrent.futures.Future[float] = concurrent.futures.Future()
    down_at = time.monotonic()
    take_down()

    def bring_back() -> None:
        try:
            time.sleep(max(seconds - (time.monotonic() - down_at), 0.0))
            start()
            outage.set_result(time.monotonic() - down_at)
        except BaseException as e:
            outage.set_exception(e)

    threading.Thread(target=bring_back, name=name, daemon=True).start()
    return outage


def log_tail(paths: list[Path], lines: int = 30) -> str:
    """The last `lines` of the first of `paths` that has any (the console, then the log)."""
    for path in paths:
        if path.is_file():
            text = path.read_text(errors="replace").splitlines()[-lines:]
            if text:
                return "\n".join(text)
    return ""
