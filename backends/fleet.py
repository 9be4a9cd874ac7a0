"""The fleet: every pool of the gateway and its endpoints, alive for the gateway's lifetime.

The gateway reads it (routing candidates, readiness); backends' background tasks keep it current
(launching, health, scraping). It is built from the `pools:` list of gateway.yaml.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from backends.config import PoolConfig
from backends.lora import LoraAdapter
from backends.topology import UNKNOWN
from backends.types import Endpoint, EndpointState, Role


@dataclass(slots=True, eq=False)
class Pool:
    config: PoolConfig
    endpoints: list[Endpoint] = field(default_factory=list)
    disaggregated: bool = field(init=False)  # has prefill/decode roles (fixed by its config)
    # its config's name, kept as a field: the request path reads it a dozen times per request
    name: str = field(init=False)

    def __post_init__(self) -> None:
        self.disaggregated = self.config.disaggregated
        self.name = self.config.name

    def ready_endpoints(self, role: Role | None = None) -> list[Endpoint]:
        return [
            e
            for e in self.endpoints
            if e.state is EndpointState.READY and (role is None or e.role is role or e.role is Role.BOTH)
        ]

    def servable(self, exclude: Collection[str] = ()) -> list[Endpoint]:
        """Ready endpoints that can serve a whole request (not prefill-only), minus `exclude`."""
        return [
            e
            for e in self.endpoints
            if e.state is EndpointState.READY and e.role is not Role.PREFILL and e.id not in exclude
        ]

    def serves_besides(self, endpoint: Endpoint, exclude: Collection[str]) -> bool:
        """Whether a `servable` endpoint other than `endpoint` is left (asked on every send: no list built)."""
        for e in self.endpoints:
            if (
                e is not endpoint
                and e.state is EndpointState.READY
                and e.role is not Role.PREFILL
                and e.id not in exclude
            ):
                return True
        return False

    @property
    def has_ready(self) -> bool:
        """Whether the pool can serve: a ready endpoint that decodes (a prefill-only one cannot)."""
        return any(e.state is EndpointState.READY and e.role is not Role.PREFILL for e in self.endpoints)

    @property
    def can_serve(self) -> bool:
        """Whether a request for the pool will be served: a ready endpoint, or an autoscaled pool that
        starts or wakes one on demand (scaled to zero, not failed)."""
        if self.has_ready:
            return True
        return self.config.elastic and any(e.launched and e.state is not EndpointState.DEAD for e in self.endpoints)


def _no_adapters() -> Mapping[str, LoraAdapter]:
    return {}


class Fleet:
    """Pools by name and by public model name."""

    def __init__(self, pools: Iterable[Pool]) -> None:
        self.pools: dict[str, Pool] = {p.name: p for p in pools}
        self._by_model: dict[str, list[Pool]] = {}
        for pool in self.pools.values():
            self._by_model.setdefault(pool.config.model, []).append(pool)
        for listed in self._by_model.values():  # overflow pools are routed to after the owned ones
            listed.sort(key=lambda pool: pool.config.overflow)
        # LoRA adapters by name, read from the live policy (the gateway points this at it): an adapter
        # is served by its base model's pools (docs/adapters.md)
        self._adapters: Callable[[], Mapping[str, LoraAdapter]] = _no_adapters

    def follow_adapters(self, source: Callable[[], Mapping[str, LoraAdapter]]) -> None:
        """Read the adapters from `source` (the current policy's, so a reload changes them at once)."""
        self._adapters = source

    @property
    def adapters(self) -> Mapping[str, LoraAdapter]:
        return self._adapters()

    def adapter(self, model: str) -> LoraAdapter | None:
        """The adapter a public model name denotes, or None for a model of its own."""
        return self._adapters().get(model)

    @classmethod
    def from_configs(cls, configs: Sequence[PoolConfig]) -> Fleet:
        """A fleet of the pools' static endpoints; launched replicas are added by the supervisor."""
        pools = []
        for cfg in configs:
            pool = Pool(cfg)
            for i, static in enumerate(cfg.endpoints):
                pool.endpoints.append(
                    Endpoint(
                        id=f"{cfg.name}/{static.role.value}-s{i}",
                        pool=cfg.name,
                        base_url=static.url,
                        engine=cfg.engine,
                        served_model=cfg.upstream_model,
                        role=static.role,
                        api_key=static.api_key or cfg.api_key,
                        max_model_len=cfg.max_model_len,
                        kv_events_endpoint=static.kv_events_endpoint,
                        kv_events_replay_endpoint=static.kv_events_replay_endpoint,
                        topology=static.topology.labels() if static.topology is not None else UNKNOWN,
                    )
                )
            pools.append(pool)
        return cls(pools)

    def pools_for_model(self, model: str) -> list[Pool]:
        pools = self._by_model.get(model)
        if pools is None:
            adapter = self._adapters().get(model)
            if adapter is not None:  # an adapter runs on its base model's pools
                return self._by_model.get(adapter.base_model, [])
        return pools or []

    @property
    def models(self) -> list[str]:
        return list(self._by_model)

    def endpoints(self) -> Iterable[Endpoint]:
        for pool in self.pools.values():
            yield from pool.endpoints

    def endpoint(self, endpoint_id: str) -> Endpoint | None:
        for e in self.endpoints():
            if e.id == endpoint_id:
                return e
        return None
