"""Typed keys for the objects the app factory builds (aiohttp `AppKey`: the value type travels with it)."""

from __future__ import annotations

import aiohttp
from aiohttp import web

from backends.config import BackendsSettings
from backends.discovery.service import Discovery
from backends.fleet import Fleet
from backends.kv_events import KvEventHub
from backends.supervisor import Supervisor
from gateway.app.policy_reload import PolicyWatcher
from gateway.app.settings import GatewaySettings
from gateway.console.activity import ConsoleActivity
from gateway.console.sessions import ConsoleSessions
from gateway.console.shared import SharedActivity
from gateway.console.tenant_spend import TenantSpend
from gateway.flow.queue import FlowQueue
from gateway.ledger.writer import LedgerWriter
from gateway.replicas.bus import ReplicaBus
from gateway.request import Director
from gateway.telemetry.metrics import FlowMetrics, GatewayMetrics
from gateway.telemetry.tracing import Tracing
from gateway.transport.provider_quota import ProviderQuotas
from gateway.upstream.client import UpstreamClient
from policies.flow.saturation import FlowSettings
from policies.holder import PolicyHolder
from policies.keys.directory import KeyDirectory
from policies.limits.admission import Admission
from policies.routing.config import RoutingConfig
from policies.routing.pipeline import ScoringRouter
from predictor.service import LatencyPredictor

SETTINGS = web.AppKey("settings", GatewaySettings)
SESSION = web.AppKey("side_session", aiohttp.ClientSession)  # the gateway's own calls (tokenizers)
UPSTREAM = web.AppKey("upstream", UpstreamClient)  # relayed requests
FLEET = web.AppKey("fleet", Fleet)
BACKENDS = web.AppKey("backends_settings", BackendsSettings)
SUPERVISOR = web.AppKey("supervisor", Supervisor)
DISCOVERY: web.AppKey[Discovery | None] = web.AppKey("discovery")  # None: no pool discovers endpoints
DIRECTOR = web.AppKey("director", Director)  # the walk of every API request
ROUTING_CONFIG = web.AppKey("routing_config", RoutingConfig)
ROUTER = web.AppKey("router", ScoringRouter)
KV_HUB: web.AppKey[KvEventHub | None] = web.AppKey("kv_hub")  # None unless prefix_index.mode is precise
METRICS = web.AppKey("metrics", GatewayMetrics)
TRACING = web.AppKey("tracing", Tracing)
LEDGER: web.AppKey[LedgerWriter | None] = web.AppKey("ledger")  # None: ledger disabled
PREDICTOR: web.AppKey[LatencyPredictor | None] = web.AppKey("predictor")  # None: predictor disabled
POLICIES = web.AppKey("policies", PolicyHolder)  # `.current` is the live Policy (hot-reloaded)
POLICY_WATCHER = web.AppKey("policy_watcher", PolicyWatcher)
ADMISSION = web.AppKey("admission", Admission)
PROVIDER_QUOTAS = web.AppKey(
    "provider_quotas", ProviderQuotas
)  # hosted providers' limits (transport/provider_quota.py)
# None: the console shows this process's activity alone (no shared state: gateway/console/shared.py)
SHARED_ACTIVITY: web.AppKey[SharedActivity | None] = web.AppKey("shared_activity")
REPLICAS: web.AppKey[ReplicaBus | None] = web.AppKey("replicas")  # None: replicas do not share routing state
DIRECTORY = web.AppKey("directory", KeyDirectory)  # keys and tenants made through the admin API
CONSOLE_SESSIONS = web.AppKey("console_sessions", ConsoleSessions)  # logins of the web console
CONSOLE_ACTIVITY = web.AppKey("console_activity", ConsoleActivity)  # the last hour and the live tail
# each tenant's spend from the ledger (the tenant list's column); None: the ledger is off
TENANT_SPEND: web.AppKey[TenantSpend | None] = web.AppKey("tenant_spend")
FLOW = web.AppKey("flow", FlowQueue)  # flow control's waiting rooms, one per pool
FLOW_SETTINGS = web.AppKey("flow_settings", FlowSettings)
FLOW_METRICS = web.AppKey("flow_metrics", FlowMetrics)
