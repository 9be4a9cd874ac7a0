"""gateway.yaml: one typed settings tree, and how it is loaded.

`GatewaySettings` holds every section as the model of the room that owns it (the gateway's own in
this module, below, the pools and the supervisor in `backends/config.py`, routing, flow control,
the predictor and batch beside their code), so the whole file is validated once, when it is loaded,
and the code receives typed objects: a mistake anywhere stops start-up (and `tokenway check`) with one
message naming the file, the key path and what was expected, never later on the path that reads it.
Loading resolves `${ENV}` references (secrets never live in YAML) and relative paths (against the
config file's folder). `docs/configuration.md` is generated from this tree (`gateway/app/config_doc.py`).

## The gateway room's own sections

The gateway room's own sections of gateway.yaml: `server`, `state` (with `state.replicas`), `apis`,
`epp`, `ledger` and `telemetry`.

One module for the small sections so that the whole tree is read in few places: the other rooms keep
their sections beside the code that uses them (`backends/config.py` the pools and the supervisor,
`policies/routing/config.py`, `policies/flow/saturation.py`, `predictor/config.py`,
`gateway/batch/config.py`), and `GatewaySettings` composes them, validated once when the file is
loaded. These are pydantic models only; no behaviour beyond validation.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from types import UnionType
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from backends.config import BackendsSettings, PoolConfig
from gateway.batch.config import BatchSettings
from policies.flow.saturation import FlowAdvanced, FlowSettings
from policies.routing.config import PrefixIndexAdvanced, RoutingConfig
from predictor.config import PredictorAdvanced, PredictorSettings


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --- server: the listening socket, bodies, timeouts towards engines -------------------------------


class FirstTokenDeadline(_Strict):
    """`server.first_token_deadline`: a stream that has shown its client nothing by then moves to another
    replica (gateway/upstream/replica_loss.py). The deadline is `factor` x the predictor's TTFT p90 for the chosen
    replica (`default_s` without a prediction), clamped to [`min_s`, `max_s`]; it is armed only while
    another replica may still take the request (never on its last try)."""

    enabled: bool = Field(
        default=True, description="false: a stream waits for its first token as long as the engine allows"
    )
    factor: float = Field(default=3.0, gt=0, description="x the predicted TTFT p90")
    default_s: float = Field(default=10.0, gt=0, description="without a prediction")
    min_s: float = Field(default=2.0, gt=0, description="the deadline is never shorter (short predictions are noisy)")
    max_s: float = Field(
        default=30.0, gt=0, description="nor longer (a bad prediction must not keep a stalled replica)"
    )
    misses_to_stall: int = Field(
        default=2, ge=1, description="deadlines a replica misses with no sign of life between them: stalled"
    )


class UserConfig(_Strict):
    """`server.users[]`: a person or a service with a role on the operator surfaces, and the API
    tokens it presents (`Authorization: Bearer`), stored as SHA-256 digests like policies.yaml keys
    (`tokenway users token NAME` prints a fresh token and its digest). docs/security.md#roles."""

    name: str = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._@+-]{0,127}$", description="who, as the audit log names them (user:NAME)"
    )
    role: Literal["admin", "team_admin", "viewer"] = Field(
        description="admin: everything; team_admin: reads, and its teams' keys and tenants; viewer: reads"
    )
    teams: list[str] = Field(default_factory=list, description="the teams of policies.yaml a team_admin manages")
    tokens_sha256: list[str] = Field(
        default_factory=list, description="SHA-256 (hex) of each API token of this user; several while rotating"
    )
    emails: list[str] = Field(
        default_factory=list, description="OIDC logins whose verified `email` claim is one of these become this user"
    )

    @field_validator("tokens_sha256")
    @classmethod
    def _hex_digests(cls, value: list[str]) -> list[str]:
        for digest in value:
            if len(digest) != 64 or any(c not in "0123456789abcdefABCDEF" for c in digest):
                raise ValueError(f"{digest[:80]!r}: a SHA-256 digest is 64 hex characters")
        return [digest.lower() for digest in value]

    @field_validator("emails")
    @classmethod
    def _lower_emails(cls, value: list[str]) -> list[str]:
        return [email.strip().lower() for email in value]


OidcAlgorithm = Literal["RS256", "RS384", "RS512", "PS256", "ES256", "ES384", "EdDSA"]


def _default_algorithms() -> list[OidcAlgorithm]:
    return ["RS256", "ES256"]


class OidcGroupRole(_Strict):
    """`server.oidc.group_roles.<group>`: the role a value of the groups claim grants."""

    role: Literal["admin", "team_admin", "viewer"] = Field(description="the role of members of this group")
    teams: list[str] = Field(default_factory=list, description="the teams a team_admin of this group manages")


class OidcConfig(_Strict):
    """`server.oidc`: console login through an OpenID Connect provider (authorization code + PKCE),
    beside the token login (gateway/console/sessions.py, docs/security.md#single-sign-on-oidc)."""

    issuer: str = Field(description="the provider's issuer URL (its /.well-known/openid-configuration is read)")
    client_id: str = Field(min_length=1, description="this gateway's client id at the provider")
    client_secret: str | None = Field(
        default=None, description="for a confidential client (use ${ENV}); a public client sends PKCE only"
    )
    redirect_url: str | None = Field(
        default=None,
        description="the callback registered at the provider, ending in /ui/oidc/callback; "
        "default: the request's scheme and Host + /ui/oidc/callback",
    )
    scopes: list[str] = Field(default_factory=lambda: ["openid", "email", "profile"], description="asked for")
    groups_claim: str = Field(default="groups", description="the ID token claim listing the user's groups")
    group_roles: dict[str, OidcGroupRole] = Field(
        default_factory=dict, description="groups claim value -> role (and teams); the highest role of a user's wins"
    )
    trust_unverified_email: bool = Field(
        default=False, description="map an `email` to server.users[].emails even without email_verified: true"
    )
    label: str = Field(default="Log in with single sign-on", max_length=80, description="the console's button")
    algorithms: list[OidcAlgorithm] = Field(
        default_factory=_default_algorithms, description="ID token signatures accepted (never none or HS*)"
    )
    timeout_s: float = Field(default=10.0, gt=0, description="each call to the provider")
    leeway_s: float = Field(default=60.0, ge=0, le=600, description="clock skew allowed on exp and iat")

    @field_validator("issuer")
    @classmethod
    def _https_issuer(cls, value: str) -> str:
        if not _https_or_loopback(value):
            raise ValueError("https:// (http:// only on a loopback address, for tests)")
        return value.rstrip("/")

    @field_validator("redirect_url")
    @classmethod
    def _callback(cls, value: str | None) -> str | None:
        if value is not None and (not _https_or_loopback(value) or not value.endswith("/ui/oidc/callback")):
            raise ValueError("an https:// URL ending in /ui/oidc/callback (http:// only on a loopback address)")
        return value


def _https_or_loopback(url: str) -> bool:
    if url.startswith("https://"):
        return True
    host = url.removeprefix("http://").split("/", 1)[0].rsplit(":", 1)[0].strip("[]")
    return url.startswith("http://") and host in ("127.0.0.1", "localhost", "::1")


class ServerSettings(_Strict):
    host: str = Field(
        default="127.0.0.1",
        description="address the gateway listens on (0.0.0.0: every interface)",
    )
    port: int = Field(default=8080, ge=0, le=65535, description="port the gateway listens on (0: any free port)")
    max_body_bytes: int = Field(
        default=16 * 1024 * 1024, ge=1024, description="larger request bodies are refused with 413"
    )
    max_inflight_body_bytes: int = Field(
        default=64 * 1024 * 1024, ge=1024, description="request bodies being read and counted, all at once"
    )
    max_header_bytes: int = Field(default=16 * 1024, ge=1024, description="one header line / field")
    request_read_timeout_s: float = Field(default=30.0, gt=0, description="full request must arrive within")
    drain_timeout_s: float = Field(default=30.0, ge=0, description="SIGTERM: in-flight requests finish within")
    upstream_connect_timeout_s: float = Field(
        default=5.0,
        gt=0,
        description="connecting to an engine takes at most this; then the request may try another (upstream_retries)",
    )
    upstream_read_timeout_s: float = Field(default=600.0, gt=0, description="max silence from the engine")
    upstream_idle_timeout_s: float = Field(
        default=4.0, gt=0, description="idle keep-alive connections to engines are dropped after (uvicorn: 5 s)"
    )
    upstream_retries: int = Field(default=1, ge=0, description="extra endpoints tried before the first byte")
    first_token_deadline: FirstTokenDeadline = Field(default_factory=FirstTokenDeadline)
    stall_after_s: float = Field(
        default=10.0, gt=0, description="a replica whose requests in flight get no byte for this long is stalled"
    )
    admin_token: str | None = Field(default=None, description="bearer token for /admin/*; use ${ENV}")
    allowed_hosts: list[str] = Field(
        default_factory=list,
        description="extra Host names (name or name:port) /admin/* and /ui/* answer to besides loopback "
        "literals and localhost on the listening port; set, they are checked with an admin token too",
    )
    users: list[UserConfig] = Field(
        default_factory=list,
        description="operators with a role (admin, team_admin, viewer) and their API tokens, beside admin_token "
        "(docs/security.md#roles-and-user-tokens)",
    )
    oidc: OidcConfig | None = Field(
        default=None, description="console single sign-on through an OpenID Connect provider (null: token login only)"
    )
    retry_after_s: int = Field(default=1, ge=0, description="retry-after on 503 no_healthy_backend")
    ready_when: Literal["all_pools", "default_pool", "any_pool"] = Field(
        default="all_pools",
        description="/readyz is 200 when every pool, the default pool, or at least one pool has a ready endpoint",
    )
    default_pool: str | None = Field(default=None, description="the pool `ready_when: default_pool` watches; first")
    gc_young_threshold: int = Field(
        default=20_000, ge=0, description="allocations between young-generation GC passes; 0: Python's default"
    )
    workers: int | Literal["auto"] = Field(
        default=1,
        description="gateway processes sharing the port (SO_REUSEPORT) and their state; auto: one per core "
        "(docs/scale-out.md#workers-several-processes-on-one-host)",
    )

    @field_validator("workers")
    @classmethod
    def _positive_workers(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError("at least 1 (or auto)")
        return value

    @field_validator("admin_token")
    @classmethod
    def _empty_is_unset(cls, value: str | None) -> str | None:
        return value or None  # `${TOKENWAY_ADMIN_TOKEN:-}` unset: no token (and no start beyond loopback)

    @field_validator("users")
    @classmethod
    def _distinct_users(cls, value: list[UserConfig]) -> list[UserConfig]:
        names: set[str] = set()
        digests: set[str] = set()
        for user in value:
            if user.name in names:
                raise ValueError(f"user {user.name!r} is listed twice")
            names.add(user.name)
            if user.role == "team_admin" and not user.teams:
                raise ValueError(f"user {user.name!r}: a team_admin names the teams it manages (teams: [...])")
            for digest in user.tokens_sha256:
                if digest in digests:
                    raise ValueError(f"user {user.name!r}: a token digest is listed twice")
                digests.add(digest)
        return value

    @field_validator("allowed_hosts")
    @classmethod
    def _bare_host_names(cls, value: list[str]) -> list[str]:
        for name in value:
            if not name or any(c in name for c in "/@ \t*") or "://" in name:
                raise ValueError(f"{name!r}: a host name or name:port (no scheme, path or wildcard)")
        return [name.strip().lower() for name in value]


# --- state.replicas: gateway replicas that act as one (needs `state: redis`) ---------------------


class ReplicasAdvanced(_Strict):
    """`state.replicas.advanced`: the shared stream's pace and bounds. Their defaults were measured
    (bench/overhead/replicas.py, bench/replay); a change is a benchmark's decision, not a deployment's."""

    publish_interval_ms: float = Field(
        default=2.0,
        gt=0,
        description="batches go out at most this often: load reports this late make prefix holders look busy",
    )
    heartbeat_s: float = Field(default=1.0, gt=0, description="the load report is repeated this often unchanged")
    ttl_s: float = Field(
        default=3.0, gt=0, description="a replica silent this long no longer counts (its load ages out)"
    )
    stream_max_len: int = Field(default=20_000, ge=100, description="entries Redis keeps (approximate trim)")
    bootstrap_entries: int = Field(default=5_000, ge=0, description="recent entries a starting replica replays")
    max_pending_dispatches: int = Field(
        default=20_000, ge=1, description="dispatches waiting for the next batch; beyond, the oldest are dropped"
    )
    max_keys_per_dispatch: int = Field(
        default=2_048, ge=1, description="block keys shared per dispatch (the prompt's head: it is what others hit)"
    )


class ReplicasSettings(_Strict):
    share: bool | None = Field(
        default=None, description="publish and fold routing state through Redis; default: on with `backend: redis`"
    )
    id: str | None = Field(
        default=None, description="this replica's name in shared state; default host-pid-random (use ${POD_NAME})"
    )
    advanced: ReplicasAdvanced = Field(
        default_factory=ReplicasAdvanced, description="expert tunables: the shared stream's pace and bounds"
    )


# --- state: where shared state lives -------------------------------------------------------------


class StateSettings(_Strict):
    backend: Literal["memory", "redis"] = Field(
        default="memory",
        description="memory: this process alone; redis: limits, keys and routing state shared by replicas",
    )
    redis_url: str | None = Field(
        default=None, description="redis://host:port/db with backend redis (use ${ENV} for a password)"
    )
    key_prefix: str = Field(
        default="tokenway", description="prefix of every Redis key, so several gateways can share one Redis"
    )
    redis_timeout_s: float = Field(
        default=0.1,
        gt=0,
        le=30,
        description="bound on each admission call to Redis (connect and read); a call past it counts "
        "as a store failure for the breaker and `store_failure`",
    )
    replicas: ReplicasSettings = Field(default_factory=ReplicasSettings)
    keys_db: str | None = Field(
        default="var/keys.sqlite3",
        description="the SQLite file of keys and tenants made through the admin API (null: kept in memory "
        "only); with redis they live in Redis and this file is each replica's durable copy, put back into "
        "a Redis that restarted empty (null: Redis only)",
    )

    @property
    def shares_routing(self) -> bool:
        """Whether replicas publish and fold routing state (on by default with Redis)."""
        share = self.replicas.share
        return self.backend == "redis" and self.redis_url is not None and (share is None or share)


# --- apis: limits of the stored responses (Responses API `store`) ----------------------------------


class ResponseStoreSettings(_Strict):
    """Bounds are per owner (the API key that made the response) first: a key over its own count or
    bytes loses its own oldest responses, never another key's. The process-wide bounds (`state:
    memory`) only guard the process: when they are reached a new response is answered but not stored."""

    enabled: bool = Field(
        default=True, description="false: Responses API `store` is ignored and `previous_response_id` is refused"
    )
    ttl_s: float = Field(default=7 * 24 * 3600.0, gt=0, description="a stored response is forgotten after this")
    max_responses_per_key: int = Field(
        default=1000, ge=1, description="per API key (both backends): its own oldest are dropped beyond it"
    )
    max_bytes_per_key: int = Field(
        default=32 * 1024 * 1024, ge=1, description="per API key (both backends): its own oldest are dropped beyond it"
    )
    max_responses: int = Field(default=10_000, ge=1, description="the whole process (memory): beyond it, not stored")
    max_bytes: int = Field(
        default=256 * 1024 * 1024, ge=1, description="the whole process (memory): beyond it, not stored"
    )
    max_response_bytes: int = Field(default=4 * 1024 * 1024, ge=1, description="larger conversations are not stored")


class ApisSettings(_Strict):
    response_store: ResponseStoreSettings = Field(default_factory=ResponseStoreSettings)


# --- epp: the ext_proc gRPC listener of `tokenway epp` -------------------------------------------


class EppSettings(_Strict):
    host: str = Field(default="0.0.0.0", description="where Envoy's ext_proc filter connects")
    port: int = Field(default=9002, ge=1, le=65535, description="the Inference Extension's default EPP port")
    max_body_bytes: int = Field(default=16 * 1024 * 1024, ge=1024, description="larger request bodies are a 413")
    request_body_mode: Literal["FULL_DUPLEX_STREAMED", "BUFFERED"] = Field(
        default="FULL_DUPLEX_STREAMED",
        description="the ext_proc request body mode the data plane is configured with, assumed when Envoy "
        "does not announce it (protocol_config); the Inference Extension's gateways use FULL_DUPLEX_STREAMED",
    )
    grace_s: float = Field(default=10.0, ge=0, description="SIGTERM: open exchanges finish within")


# --- ledger: the usage ledger (one JSON line per finished request) ---------------------------------


class RedisStreamConfig(_Strict):
    url: str = Field(description="redis://host:port/db (use ${ENV} for a password)")
    stream: str = Field(default="tokenway:usage", description="the stream's key")
    maxlen: int = Field(default=1_000_000, ge=1, description="approximate cap (XADD MAXLEN ~)")
    timeout_s: float = Field(
        default=2.0, gt=0, description="one XADD call; a slow Redis drops batches, never blocks the writer"
    )
    max_pending_batches: int = Field(default=256, ge=1, description="beyond this, oldest batches are dropped")


class LedgerPostgresConfig(_Strict):
    """A copy of every ledger record in a PostgreSQL table (gateway/ledger/postgres.py), for
    `tokenway usage sql --dsn`. Needs the `postgres` extra (psycopg)."""

    dsn: str = Field(description="postgresql://user@host:5432/db (use ${ENV} for a password)")
    table: str = Field(
        default="usage", pattern=r"^[a-z_][a-z0-9_]{0,62}$", description="the table, created when missing"
    )
    timeout_s: float = Field(
        default=5.0, gt=0, description="connecting and each batch's insert; a slow database drops, never blocks"
    )
    max_pending_batches: int = Field(
        default=256, ge=1, description="committed groups waiting for PostgreSQL; beyond this the oldest are dropped"
    )


class AuditConfig(_Strict):
    """The audit log of admin changes (gateway/audit): one fsync'd line per change, rotated by size."""

    enabled: bool = Field(default=True, description="record every admin change (who, when, what, before and after)")
    dir: str = Field(
        default="var/audit",
        description="directory of the audit files, relative to the working directory like ledger.dir; one per host",
    )
    file_prefix: str = Field(
        default="audit",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="files are PREFIX.jsonl, PREFIX.jsonl.1, …",
    )
    rotate_bytes: int = Field(
        default=16 * 1024 * 1024, ge=4096, description="the current file is rotated before it would pass this size"
    )
    keep_files: int = Field(
        default=10, ge=1, le=1000, description="rotated files kept beside the current one; older ones are deleted"
    )
    redis_stream: str = Field(
        default="tokenway:audit",
        min_length=1,
        description="with the ledger's Redis stream on, each record is also XADDed to this stream (same Redis); "
        "on the state's default stream this default reads `<state.key_prefix>:audit`",
    )


class ReconcileConfig(_Strict):
    """Spend reconciliation (gateway/ledger/reconcile.py, docs/governance.md)."""

    enabled: bool = Field(
        default=True, description="compare each key's enforced spend counters with the ledger's records"
    )
    interval_s: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description="how often; with Redis also how often this replica's recorded sums reach the others",
    )
    tolerance_usd: float = Field(default=0.01, ge=0, description="a key's drift past this many dollars ...")
    tolerance_ratio: float = Field(
        default=0.01, ge=0, description="... and past this share of its recorded spend is listed and counted"
    )
    max_keys: int = Field(
        default=1000, ge=1, le=100_000, description="keys compared per period (those that spent most); the rest summed"
    )


class LedgerConfig(_Strict):
    enabled: bool = Field(default=True, description="write one usage record per finished request")
    dir: str = Field(
        default="var/usage",
        description="directory of the ledger files; one per gateway replica (or a distinct file_prefix each)",
    )
    file_prefix: str = Field(
        default="usage", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", description="files are PREFIX-YYYYMMDD-NNN.jsonl"
    )
    commit_interval_ms: int = Field(
        default=100,
        ge=1,
        le=60_000,
        description="a record is on disk within this long of its request's end (group commit)",
    )
    rotate_bytes: int = Field(
        default=128 * 1024 * 1024, ge=4096, description="a new file starts past this size (and at each UTC midnight)"
    )
    retain_days: int | None = Field(
        default=None, ge=1, description="files older than this are deleted; null keeps everything"
    )
    fsync: bool = Field(default=True, description="fsync each group (survives power loss, not only crashes)")
    max_pending_records: int = Field(
        default=200_000, ge=1, description="records waiting for the disk beyond this are dropped and counted"
    )
    redis_stream: RedisStreamConfig | None = Field(
        default=None, description="also XADD every record to a Redis stream, for collection from many replicas"
    )
    shared_stream: bool | None = Field(
        default=None,
        description="without redis_stream, copy every record to the state's Redis (stream `<state.key_prefix>:usage`) "
        "so the console's usage and tenant spend count every replica; default: on with `state: redis`",
    )
    shared_stream_maxlen: int = Field(
        default=100_000,
        ge=1,
        description="entries that shared stream keeps (approximate trim); about 1.3 KB of Redis memory each",
    )
    reconcile: ReconcileConfig = Field(
        default_factory=lambda: ReconcileConfig(),
        description="the enforced spend counters against the ledger, per key and period, with a drift gauge",
    )
    postgres: LedgerPostgresConfig | None = Field(
        default=None, description="also insert every record into a PostgreSQL table (`tokenway usage sql --dsn`)"
    )
    audit: AuditConfig = Field(
        default_factory=AuditConfig, description="the audit log of admin changes, beside the ledger and its sinks"
    )

    def stream(self, state: StateSettings) -> RedisStreamConfig | None:
        """The Redis stream every record is copied to: `redis_stream` when set, else, with `state: redis`,
        one on the state's own Redis. Replicas that already share a Redis then need no more setup for
        the console to count all of them (docs/console.md#every-replicas-usage), and the cap keeps the
        Redis memory it costs bounded. None: the records stay in this replica's files only."""
        if self.redis_stream is not None:
            return self.redis_stream
        if self.shared_stream is False or state.backend != "redis" or state.redis_url is None:
            return None
        return RedisStreamConfig(
            url=state.redis_url, stream=f"{state.key_prefix}:usage", maxlen=self.shared_stream_maxlen
        )


# --- telemetry: Prometheus and OpenTelemetry -------------------------------------------------------


class MetricLabelsConfig(_Strict):
    """Label options. Every label is bounded: values come from config (tenants, models, pools,
    endpoints) and the guard folds anything past `max_values` into "other"."""

    key_id: bool = Field(default=False, description="per-key token and cost series (bounded by the key list)")
    max_values: int = Field(default=200, ge=1, le=100_000, description="distinct values per label")
    max_programs: int = Field(
        default=50,
        ge=0,
        le=10_000,
        description="agent runs named at a time on the tokenway_program_* series (others: program=other; 0: none)",
    )
    program_idle_s: float = Field(
        default=300.0, gt=0, description="a named run idle this long gives its program label to a new run"
    )


class MetricsConfig(_Strict):
    enabled: bool = Field(default=True, description="serve GET /metrics and count the Prometheus families")
    labels: MetricLabelsConfig = Field(default_factory=MetricLabelsConfig)
    token: str | None = Field(
        default=None, description="bearer token GET /metrics requires (it names tenants and models); use ${ENV}"
    )


class OtlpConfig(_Strict):
    endpoint: str | None = Field(default=None, description="OTLP/HTTP base URL, e.g. http://collector:4318")
    service_name: str = Field(default="tokenway", description="service.name of the exported traces and metrics")
    sample_ratio: float = Field(
        default=1.0,
        ge=0.0,
        le=1.0,
        description="share of new traces sampled at the head (a client's sampled flag is honoured)",
    )
    headers: dict[str, str] = Field(default_factory=dict, description="sent with every export (${ENV} ok)")
    timeout_s: float = Field(
        default=5.0, gt=0, description="one export attempt; a slow collector loses spans, never blocks requests"
    )
    metrics: bool = Field(default=True, description="export the GenAI metrics over OTLP as well")
    metrics_interval_s: float = Field(
        default=15.0, gt=0, description="how often the GenAI metrics are pushed over OTLP"
    )
    max_queue_spans: int = Field(default=8192, ge=16, description="spans beyond this are dropped, not waited on")

    @field_validator("endpoint")
    @classmethod
    def _base_url(cls, value: str | None) -> str | None:
        if value is None or value == "":
            return None
        value = value.rstrip("/")
        for suffix in ("/v1/traces", "/v1/metrics"):
            if value.endswith(suffix):
                value = value[: -len(suffix)]
        if not value.startswith(("http://", "https://")):
            raise ValueError("must be an http(s) URL of an OTLP/HTTP receiver, e.g. http://collector:4318")
        return value


class TelemetryConfig(_Strict):
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    otlp: OtlpConfig = Field(default_factory=OtlpConfig)


_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class ConfigError(Exception):
    """A configuration file that cannot be used; the message names file, key path and expectation."""


class GatewaySettings(BaseModel):
    """The whole of gateway.yaml; each section is its owner's model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    server: ServerSettings = Field(default_factory=ServerSettings, description="the listening socket and timeouts")
    state: StateSettings = Field(default_factory=StateSettings, description="where limits and shared state live")
    policies: str = Field(default="policies.yaml", description="path of policies.yaml (relative to this file)")
    backends: BackendsSettings = Field(
        default_factory=BackendsSettings, description="how the supervisor launches and watches engines"
    )
    pools: list[PoolConfig] = Field(default_factory=list, description="the models served and their engines")
    routing: RoutingConfig = Field(default_factory=RoutingConfig, description="which endpoint serves a request")
    flow_control: FlowSettings = Field(
        default_factory=FlowSettings, description="when a pool is saturated and how much may wait"
    )
    apis: ApisSettings = Field(default_factory=ApisSettings, description="the translated APIs' own state")
    batch: BatchSettings = Field(default_factory=BatchSettings, description="the Batch and Files APIs")
    predictor: PredictorSettings = Field(default_factory=PredictorSettings, description="latency predictions")
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig, description="Prometheus and OpenTelemetry")
    ledger: LedgerConfig = Field(default_factory=LedgerConfig, description="one usage record per request")
    epp: EppSettings = Field(default_factory=EppSettings, description="`tokenway epp`, the endpoint picker")
    source: str = Field(default="<memory>", exclude=True)

    def resolve_path(self, path: str) -> Path:
        """A path from this file, made absolute against the config file's folder."""
        p = Path(path)
        if p.is_absolute() or self.source.startswith("<"):
            return p
        return Path(self.source).parent / p


# Expert tunables live in an `advanced:` block of the model they tune (the defaults are measured; a
# change is a benchmark's decision). A key at its old place is refused with an error naming the new
# one rather than accepted with a warning: a warning in a start-up log is read too late.
ADVANCED_BLOCKS: dict[str, type[BaseModel]] = {
    "predictor": PredictorAdvanced,
    "routing.prefix_index": PrefixIndexAdvanced,
    "state.replicas": ReplicasAdvanced,
    "flow_control": FlowAdvanced,
}
MOVED_TO_ADVANCED: dict[str, str] = {
    f"{where}.{key}": f"{where}.advanced.{key}"
    for where, block in ADVANCED_BLOCKS.items()
    for key in block.model_fields
}


def resolve_env(value: Any, where: str = "", unset: list[str] | None = None) -> Any:
    """Replace `${NAME}` / `${NAME:-default}` in every string of a parsed YAML tree.

    An unset variable without a default is an error, unless `unset` is given (dry runs such as
    `tokenway pools plan`): then the reference stays as written, a placeholder, and `unset` collects
    `key.path: NAME` for the warning."""
    if isinstance(value, str):

        def sub(match: re.Match[str]) -> str:
            name, default = match.group(1), match.group(2)
            found = os.environ.get(name)
            if found is not None:
                return found
            if default is not None:
                return default
            if unset is not None:
                unset.append(f"{where or '<root>'}: {name}")
                return match.group(0)
            raise ConfigError(f"{where or '<root>'}: environment variable {name} is not set")

        return _ENV_REF.sub(sub, value)
    if isinstance(value, dict):
        return {k: resolve_env(v, f"{where}.{k}" if where else str(k), unset) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve_env(v, f"{where}[{i}]", unset) for i, v in enumerate(value)]
    return value


def format_validation_error(path: str, error: ValidationError, model: type[BaseModel] | None = None) -> str:
    """One line per problem: key path, what was expected, what was given. With `model` (the tree
    that was validated), an unknown key names the nearest valid key at its place: a misspelling is
    the commonest mistake, and the list of valid keys is long."""
    lines = [f"{path}: invalid configuration"]
    for item in error.errors():
        loc = ""
        for part in item["loc"]:
            loc += f"[{part}]" if isinstance(part, int) else (f".{part}" if loc else str(part))
        message = str(item["msg"])
        moved = MOVED_TO_ADVANCED.get(loc) if model is GatewaySettings else None
        if item["type"] == "extra_forbidden" and moved is not None:
            message = f"moved to `{moved}` (expert tunables live under `advanced:`)"
        elif item["type"] == "extra_forbidden" and model is not None and item["loc"]:
            message = "unknown key" + _nearest(str(item["loc"][-1]), keys_at(model, tuple(item["loc"][:-1])))
        elif item["type"] == "literal_error" and isinstance(item.get("input"), str):
            choices = re.findall(r"'([^']*)'", str((item.get("ctx") or {}).get("expected", "")))
            close = difflib.get_close_matches(item["input"], choices, n=1, cutoff=0.6)
            message += f"; did you mean {close[0]!r}?" if close else ""
        lines.append(f"  {loc or '<root>'}: {message} (got {_short(item.get('input'))})")
    return "\n".join(lines)


def _nearest(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    if close:
        return f"; did you mean {close[0]!r}?"
    return f"; valid keys here: {', '.join(known)}" if known else ""


def keys_at(model: type[BaseModel], loc: tuple[str | int, ...]) -> list[str]:
    """The keys valid at `loc` (a pydantic error location) inside `model`: the fields of the model
    found there, through lists, mappings, optional values and unions of models."""
    types: list[Any] = [model]
    for part in loc:
        types = [found for annotation in types for found in _step(annotation, part)]
    return sorted({name for annotation in types for name in _fields(annotation)})


def _members(annotation: Any) -> list[Any]:
    if get_origin(annotation) in (Union, UnionType):
        return [m for arg in get_args(annotation) for m in _members(arg)]
    return [annotation]


def _fields(annotation: Any) -> list[str]:
    return [
        name
        for member in _members(annotation)
        if isinstance(member, type) and issubclass(member, BaseModel)
        for name in member.model_fields
    ]


def _step(annotation: Any, part: str | int) -> list[Any]:
    """Where one step of an error location leads from `annotation` (a union member's tag stays put)."""
    found: list[Any] = []
    for member in _members(annotation):
        origin, args = get_origin(member), get_args(member)
        if isinstance(member, type) and issubclass(member, BaseModel):
            if member.__name__ == part:
                found.append(member)
            elif isinstance(part, str) and part in member.model_fields:
                found.append(member.model_fields[part].annotation)
        elif origin in (list, tuple) and args and isinstance(part, int):
            found.append(args[0])
        elif origin is dict and len(args) == 2:
            found.append(args[1])
    return found


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


M = TypeVar("M", bound=BaseModel)


def load_yaml_model(
    path: str | Path, model: type[M], extra: dict[str, Any] | None = None, unset: list[str] | None = None
) -> M:
    """Read a YAML file into a pydantic model with precise errors (file, key path, expectation).
    `unset`: see `resolve_env` (unset variables kept as placeholders and listed there)."""
    path = str(path)
    try:
        with open(path, encoding="utf-8") as fh:
            raw = yaml.safe_load(fh)
    except FileNotFoundError as exc:
        raise ConfigError(f"{path}: file not found") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(raw).__name__}")
    try:
        raw = resolve_env(raw, unset=unset)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    try:
        return model.model_validate({**raw, **(extra or {})})
    except ValidationError as exc:
        raise ConfigError(format_validation_error(path, exc, model)) from exc


def load_settings(path: str | Path, unset: list[str] | None = None) -> GatewaySettings:
    return load_yaml_model(path, GatewaySettings, {"source": str(path)}, unset)
