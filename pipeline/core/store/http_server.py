"""ClickHouse's HTTP interface, read-only, for the embedded engine a running sink holds.

chDB lets one process open a data directory, and while the sink runs that
process is the sink. So the sink serves the engine it already has: `report`,
`board`, a user's clickhouse-connect client and Grafana's ClickHouse plugin
(HTTP protocol) ask their SQL here while events flow.

Enough of ClickHouse's protocol for those clients: the query in the `query`
parameter and/or the POST body, `database` (or X-ClickHouse-Database),
`default_format` (or X-ClickHouse-Format) or a trailing `FORMAT`, server-side parameters `param_<name>`, HTTP compression (gzip,
deflate), basic auth or the X-ClickHouse-User/Key headers or user/password
parameters, and the X-ClickHouse-* response headers. The engine formats the
answer itself, so every output format ClickHouse has works.

Nothing can write: the engine handle runs with `readonly = 1` (no INSERT, DDL,
setting changes or file/url table functions), only reading statements are
accepted, and `INTO OUTFILE` (which chDB honours even read-only) is refused.
Per-request ClickHouse settings are ignored, as a read-only user's are.
"""

from __future__ import annotations

import base64
import gzip
import hmac
import json
import re
import threading
import time
import uuid
import zlib
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import chdb

from pipeline.core.store.identifiers import checked_identifier

READING = re.compile(r"^(SELECT|WITH|SHOW|DESCRIBE|DESC|EXISTS|EXPLAIN)\b", re.IGNORECASE)
OUTFILE = re.compile(r"\bINTO\s+OUTFILE\b", re.IGNORECASE)
TRAILING_FORMAT = re.compile(r"\bFORMAT\s+([A-Za-z][A-Za-z0-9_]*)\s*;?\s*$", re.IGNORECASE)
CONTENT_TYPES = {
    "TabSeparated": "text/tab-separated-values; charset=UTF-8",
    "TSV": "text/tab-separated-values; charset=UTF-8",
    "CSV": "text/csv; charset=UTF-8",
    "JSON": "application/json; charset=UTF-8",
    "JSONCompact": "application/json; charset=UTF-8",
    "JSONEachRow": "application/x-ndjson; charset=UTF-8",
}
BINARY = "application/octet-stream"
ERROR_CODE = re.compile(r"Code: (\d+)")
READONLY_CODE = 164
AUTH_CODE = 516
SYNTAX_CODE = 62


class Refused(Exception):
    """A request this server will not run; carries ClickHouse's error code and an HTTP status."""

    def __init__(self, code: int, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.status = status


@dataclass(frozen=True)
class Credentials:
    user: str
    password: str

    def accepts(self, user: str | None, password: str | None) -> bool:
        given_user = (user or "default").encode()
        given_password = (password or "").encode()
        return hmac.compare_digest(given_user, self.user.encode()) & hmac.compare_digest(
            given_password, self.password.encode()
        )


def code_only(sql: str) -> str:
    """The SQL with every comment and quoted literal or identifier blanked, scanned left to right
    (so a quote inside a comment, or `--` inside a string, cannot hide what follows)."""
    out: list[str] = []
    i, n = 0, len(sql)
    while i < n:
        two = sql[i : i + 2]
        if two == "--" or sql[i] == "#":
            end = sql.find("\n", i)
            i = n if end < 0 else end
        elif two == "/*":
            end = sql.find("*/", i + 2)
            i = n if end < 0 else end + 2
        elif sql[i] in "'\"`":
            quote, i = sql[i], i + 1
            while i < n and sql[i] != quote:
                i += 2 if sql[i] == "\\" else 1
            i += 1
            out.append(" '' ")
            continue
        else:
            out.append(sql[i])
            i += 1
            continue
        out.append(" ")
    return "".join(out).strip()


def check_read_only(sql: str) -> None:
    """Refuse anything that is not one reading statement."""
    code = code_only(sql).lstrip("(").strip()
    if not READING.match(code):
        first = code.split(None, 1)[0] if code else "(empty)"
        raise Refused(
            READONLY_CODE,
            HTTPStatus.FORBIDDEN,
            f"{first} is not a read: this server runs SELECT, WITH, SHOW, DESCRIBE, EXISTS and EXPLAIN only",
        )
    if OUTFILE.search(code):
        raise Refused(READONLY_CODE, HTTPStatus.FORBIDDEN, "INTO OUTFILE writes a file: refused")
    if ";" in code.rstrip().rstrip(";"):
        raise Refused(SYNTAX_CODE, HTTPStatus.BAD_REQUEST, "one statement per request")


class ReadOnlyEngine:
    """One chDB handle on the sink's data directory, switched to readonly=1, used by one request at a time."""

    def __init__(self, data_dir: Path) -> None:
        self._conn = chdb.connect(str(data_dir.resolve()))
        self._conn.query("SET readonly = 1")
        self._lock = threading.Lock()
        tz, version = (
            self._conn.query("SELECT timezone(), version()", "TabSeparated").bytes().decode().strip().split("\t")
        )
        self.timezone, self.version = tz, version

    def run(self, sql: str, fmt: str, database: str | None, params: dict[str, str]) -> tuple[bytes, dict[str, Any]]:
        with self._lock:
            if database:
                self._conn.query(f"USE {checked_identifier(database)}")
            result = self._conn.query(sql, fmt, params=params)
            summary = {
                "read_rows": str(result.rows_read()),
                "read_bytes": str(result.bytes_read()),
                "written_rows": "0",
                "written_bytes": "0",
                "result_rows": str(result.rows_read()),
                "elapsed_ns": str(int(result.elapsed() * 1e9)),
            }
            return result.bytes(), summary

    def close(self) -> None:
        with self._lock:
            self._conn.close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: ReadOnlyHTTPServer

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: a dashboard polls often, and the sink's log is about events."""

    def do_GET(self) -> None:
        self._serve(post=False)

    def do_POST(self) -> None:
        self._serve(post=True)

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            raw = b"".join(chunks)
        else:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        encoding = self.headers.get("Content-Encoding", "").lower()
        if encoding == "gzip":
            return gzip.decompress(raw)
        if encoding == "deflate":
            return zlib.decompress(raw)
        if encoding:
            raise Refused(
                SYNTAX_CODE,
                HTTPStatus.BAD_REQUEST,
                f"request Content-Encoding {encoding} is not supported (gzip, deflate)",
            )
        return raw

    def _serve(self, *, post: bool) -> None:
        query_id = str(uuid.uuid4())
        try:
            body = self._body() if post else b""
            url = urlsplit(self.path)
            params = dict(parse_qsl(url.query, keep_blank_values=True))
            sql = "\n".join(part for part in (params.get("query", ""), body.decode("utf-8")) if part.strip())
            if url.path in ("/ping", "/") and not sql:
                self._send(HTTPStatus.OK, b"Ok.\n", {"Content-Type": "text/plain; charset=UTF-8"})
                return
            self._authenticate(params)
            if params.get("compress") == "1":
                raise Refused(
                    SYNTAX_CODE,
                    HTTPStatus.BAD_REQUEST,
                    "compress=1 (ClickHouse block compression) is not supported; use HTTP compression",
                )
            check_read_only(sql)
            named = TRAILING_FORMAT.search(code_only(sql))
            fmt = (
                named.group(1)
                if named
                else (params.get("default_format") or self.headers.get("X-ClickHouse-Format") or "TabSeparated")
            )
            database = params.get("database") or self.headers.get("X-ClickHouse-Database") or self.server.database
            bound = {k[len("param_") :]: v for k, v in params.items() if k.startswith("param_")}
            data, summary = self.server.engine.run(sql, fmt, database, bound)
        except Refused as e:
            self._error(e.status, e.code, str(e), query_id)
            return
        except Exception as e:
            found = ERROR_CODE.search(str(e))
            self._error(
                HTTPStatus.INTERNAL_SERVER_ERROR if found else HTTPStatus.BAD_REQUEST,
                int(found.group(1)) if found else 0,
                str(e),
                query_id,
            )
            return
        headers = {
            "Content-Type": CONTENT_TYPES.get(fmt, BINARY),
            "X-ClickHouse-Format": fmt,
            "X-ClickHouse-Query-Id": params.get("query_id") or query_id,
            "X-ClickHouse-Timezone": self.server.engine.timezone,
            "X-ClickHouse-Server-Display-Name": "batchtide-sink",
            "X-ClickHouse-Summary": json.dumps(summary),
        }
        self._send(HTTPStatus.OK, data, headers)

    def _authenticate(self, params: dict[str, str]) -> None:
        user, password = self.headers.get("X-ClickHouse-User"), self.headers.get("X-ClickHouse-Key")
        auth = self.headers.get("Authorization", "")
        if auth.lower().startswith("basic "):
            user, _, password = base64.b64decode(auth[6:]).decode().partition(":")
        user = params.get("user", user)
        password = params.get("password", password)
        if not self.server.credentials.accepts(user, password):
            raise Refused(
                AUTH_CODE,
                HTTPStatus.FORBIDDEN,
                f"{user or 'default'}: Authentication failed: password is incorrect, or there is no user with such name",
            )

    def _error(self, status: HTTPStatus, code: int, message: str, query_id: str) -> None:
        text = (
            message
            if message.startswith("Code:")
            else f"Code: {code}. DB::Exception: {message}. (batchtide read-only server)"
        )
        headers = {
            "Content-Type": "text/plain; charset=UTF-8",
            "X-ClickHouse-Exception-Code": str(code),
            "X-ClickHouse-Query-Id": query_id,
        }
        self._send(status, (text.rstrip() + "\n").encode(), headers)

    def _send(self, status: HTTPStatus, data: bytes, headers: dict[str, str]) -> None:
        accepted = self.headers.get("Accept-Encoding", "")
        wants = dict(parse_qsl(urlsplit(self.path).query)).get("enable_http_compression") == "1"
        if wants and "gzip" in accepted:
            data, headers = gzip.compress(data, compresslevel=3), {**headers, "Content-Encoding": "gzip"}
        elif wants and "deflate" in accepted:
            data, headers = zlib.compress(data, 3), {**headers, "Content-Encoding": "deflate"}
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class ReadOnlyHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self, address: tuple[str, int], engine: ReadOnlyEngine, credentials: Credentials, database: str
    ) -> None:
        super().__init__(address, _Handler)
        self.engine = engine
        self.credentials = credentials
        self.database = database


class LiveServer:
    """The server in a background thread of the sink process: `start()`, then `url`; `stop()` on the way out."""

    def __init__(self, data_dir: Path, host: str, port: int, credentials: Credentials, database: str) -> None:
        self.data_dir = data_dir
        self._address = (host, port)
        self.credentials = credentials
        self.database = database
        self._server: ReadOnlyHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> LiveServer:
        engine = ReadOnlyEngine(self.data_dir)
        self._server = ReadOnlyHTTPServer(self._address, engine, self.credentials, self.database)
        self._thread = threading.Thread(target=self._server.serve_forever, name="clickhouse-http", daemon=True)
        self._thread.start()
        return self

    @property
    def port(self) -> int:
        assert self._server is not None, "start() first"
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        host = self._address[0] if self._address[0] not in ("", "0.0.0.0") else "127.0.0.1"
        return f"http://{host}:{self.port}"

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._server.engine.close()
        self._server = None


def wait_until_up(url: str, timeout_s: float = 10.0) -> bool:
    """True once `url`/ping answers (for tests and tools that start a sink)."""
    from urllib.request import urlopen

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urlopen(f"{url}/ping", timeout=1.0) as response:
                if response.status == 200:
                    return True
        except OSError:
            time.sleep(0.1)
    return False
