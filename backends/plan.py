"""Planning: which replicas exist, with which devices (the host's accelerators, allocated) and ports,
and the exact process of each.

Devices
-------
Accelerators of this host and their allocation to launched replicas.

Each replica of a pool needs `tensor_parallel x pipeline_parallel` devices. A pool either lists its
devices (`devices: [0, 1, 2, 3]`), takes free ones from the host's inventory (`devices: auto`), or
leaves them unmanaged (`devices: null`: the engine sees whatever the gateway sees, as the simulated
engine needs). The inventory is `backends.devices` when listed, else what `nvidia-smi` / `npu-smi`
report. No device is ever given to two replicas; every impossible request is a `PlanError` naming
the pool.

Replicas
--------
Planning: which replicas exist, with which devices and ports, and the exact process of each.

A simulated pool that declares a shared KV store (`kv_store:` on an `engine: sim` pool) gets the
store too: one `python -m sim store` process per pool, sized and linked as `kv_store` says, on a port
of its own, which every replica of the pool joins (`--kv-store-url`); the supervisor runs it beside
them (`PlannedStore`). A real engine's pool that declares `kv_store` names a store deployed apart
(LMCache's server, Mooncake Store), which the gateway neither starts nor configures.

`plan_replicas` is what the supervisor launches; `render_plan` prints the same plan for operators
(`tokenway pools plan --config FILE`) without launching anything, so a GPU deployment can be checked
line by line before it runs. Both go through the adapters, so what is printed is what would run.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from backends.adapters.base import EngineAdapter, LaunchSpec, ReplicaPlan
from backends.autoscale.sleep import sleep_problem, with_sleep_mode
from backends.config import BackendsSettings, PoolConfig
from backends.fleet import get_adapter
from backends.types import PlanError, Role

# Commands that list device indices, one per line / block.
_LIST_COMMANDS: dict[str, list[str]] = {
    "nvidia-smi": ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
    "npu-smi": ["npu-smi", "info", "-l"],
}
_NPU_ID = re.compile(r"NPU ID\s*:\s*(\d+)")

Runner = Callable[[list[str]], str | None]


def parse_nvidia_smi(text: str) -> tuple[int, ...]:
    """`nvidia-smi --query-gpu=index --format=csv,noheader`: one index per line."""
    return tuple(int(line.strip()) for line in text.splitlines() if line.strip().isdigit())


def parse_npu_smi(text: str) -> tuple[int, ...]:
    """`npu-smi info -l`: blocks with `NPU ID : N` lines."""
    return tuple(int(m) for m in _NPU_ID.findall(text))


_PARSERS: dict[str, Callable[[str], tuple[int, ...]]] = {
    "nvidia-smi": parse_nvidia_smi,
    "npu-smi": parse_npu_smi,
}


def _run(argv: list[str]) -> str | None:
    if shutil.which(argv[0]) is None:
        return None
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=15, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def detect_devices(tool: str, run: Runner = _run) -> tuple[int, ...] | None:
    """This host's device indices according to `tool`; None when the tool is missing or fails."""
    argv = _LIST_COMMANDS.get(tool)
    if argv is None:
        return None
    out = run(argv)
    return None if out is None else _PARSERS[tool](out)


@dataclass(frozen=True, slots=True)
class DeviceRequest:
    """One pool's need: `replicas` x `per_replica` devices, listed explicitly or "auto"."""

    pool: str
    replicas: int
    per_replica: int
    devices: tuple[int, ...] | None  # None = auto (take free ones from the inventory)
    parallel_desc: str = ""  # "TP 4 x PP 1" for messages


def allocate_devices(
    requests: Sequence[DeviceRequest], inventory: tuple[int, ...] | None, inventory_source: str = "the host"
) -> dict[str, list[tuple[int, ...]]]:
    """Devices per replica for each pool (replica order), explicit pools first, then auto ones in
    configuration order from what is left. Raises PlanError naming the pool on any conflict."""
    owner: dict[int, str] = {}
    result: dict[str, list[tuple[int, ...]]] = {}
    known = set(inventory) if inventory is not None else None
    for req in requests:
        if req.devices is None:
            continue
        needed = req.replicas * req.per_replica
        listed = req.devices
        if len(set(listed)) != len(listed):
            raise PlanError(f"pool {req.pool!r}: `devices` lists a device twice: {list(listed)}")
        if len(listed) != needed:
            raise PlanError(
                f"pool {req.pool!r}: lists {len(listed)} devices {list(listed)} but needs {needed} "
                f"({req.replicas} replicas x {req.per_replica} per replica{_paren(req.parallel_desc)})"
            )
        if known is not None:
            missing = [d for d in listed if d not in known]
            if missing:
                raise PlanError(
                    f"pool {req.pool!r}: devices {missing} do not exist on {inventory_source} (it has {sorted(known)})"
                )
        for device in listed:
            if device in owner:
                raise PlanError(f"pool {req.pool!r}: device {device} is already given to pool {owner[device]!r}")
            owner[device] = req.pool
        result[req.pool] = _chunks(listed, req.per_replica)
    for req in requests:
        if req.devices is not None:
            continue
        needed = req.replicas * req.per_replica
        if inventory is None:
            raise PlanError(
                f"pool {req.pool!r}: `devices: auto` but this host's devices are unknown "
                "(list them under `backends.devices`, or install nvidia-smi / npu-smi)"
            )
        free = [d for d in inventory if d not in owner]
        if needed > len(free):
            raise PlanError(
                f"pool {req.pool!r}: needs {needed} devices ({req.replicas} replicas x "
                f"{req.per_replica} per replica{_paren(req.parallel_desc)}) but only {len(free)} of "
                f"{inventory_source}'s {len(inventory)} are free ({free})"
            )
        taken = tuple(free[:needed])
        for device in taken:
            owner[device] = req.pool
        result[req.pool] = _chunks(taken, req.per_replica)
    return result


def _chunks(devices: tuple[int, ...], size: int) -> list[tuple[int, ...]]:
    return [tuple(devices[i : i + size]) for i in range(0, len(devices), size)]


def _paren(text: str) -> str:
    return f", {text}" if text else ""


InventoryProbe = Callable[[str], tuple[int, ...] | None]


# Ports for launched replicas: HTTP, KV-event publishers, KV-transfer side channels. Explicit ports (a
# pool's `port_base`) are claimed first; automatic ones are handed out upwards from a base, skipping
# ports already claimed and, at launch time, ports something else is listening on. A plan (no
# launching) assumes every port is free, so it is deterministic.
PortProbe = Callable[[str, int], bool]


def is_port_free(host: str, port: int) -> bool:
    """True when nothing is bound to (host, port): a bind test, released at once."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # As servers bind (SO_REUSEADDR): connections in TIME_WAIT do not make a port busy.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host.strip("[]") or "0.0.0.0", port))
        except OSError:
            return False
    return True


def assume_free(host: str, port: int) -> bool:
    return True


class PortBook:
    """Every port given out in one plan, with its owner, so no two uses share one."""

    def __init__(self, is_free: PortProbe = assume_free) -> None:
        self._owner: dict[int, str] = {}
        self._cursor: dict[int, int] = {}  # base -> next candidate
        self._is_free = is_free

    def claim(self, port: int, owner: str) -> int:
        """An explicit port; two claims of one port are a configuration error."""
        if not 0 < port < 65536:
            raise PlanError(f"{owner}: port {port} is out of range")
        if port in self._owner:
            raise PlanError(f"{owner}: port {port} is already used by {self._owner[port]}")
        self._owner[port] = owner
        return port

    def take(self, base: int, host: str, owner: str) -> int:
        """The next automatic port at or above `base` that is unclaimed and free on `host`."""
        port = self._cursor.get(base, base)
        while port < 65536:
            if port not in self._owner and self._is_free(host, port):
                self._owner[port] = owner
                self._cursor[base] = port + 1
                return port
            port += 1
        raise PlanError(f"{owner}: no free port at or above {base}")


@dataclass(frozen=True, slots=True)
class PlannedStore:
    """A simulated pool's shared KV store: its URL (what the replicas join) and its process."""

    pool: str
    url: str
    spec: LaunchSpec


@dataclass(frozen=True, slots=True)
class PlannedReplica:
    """A replica with its pool, adapter and process, ready to launch or print."""

    pool: PoolConfig
    adapter: EngineAdapter
    replica: ReplicaPlan
    spec: LaunchSpec
    store: PlannedStore | None = None  # its pool's simulated KV store, shared by the pool's replicas

    @property
    def endpoint_id(self) -> str:
        return self.replica.endpoint_id


def replica_slots(pool: PoolConfig) -> list[tuple[Role, int]]:
    """The launched replicas of a pool in a fixed order: `both` ones, then prefill, then decode. An
    autoscaled pool has a slot for every replica it may run (`max_replicas` per role)."""
    return [(role, i) for role in (Role.BOTH, Role.PREFILL, Role.DECODE) for i in range(pool.slots(role.value))]


def plan_replicas(
    pools: Sequence[PoolConfig],
    settings: BackendsSettings,
    *,
    port_is_free: PortProbe = assume_free,
    detect: InventoryProbe = detect_devices,
) -> list[PlannedReplica]:
    """Every launched replica of `pools`, with devices and ports allocated. Raises PlanError (naming
    the pool) when an adapter refuses the pool or devices/ports cannot be allocated."""
    launched = [(pool, get_adapter(pool.engine)) for pool in pools]
    launched = [
        (pool, adapter) for pool, adapter in launched if adapter.launches and (pool.launched_replicas or pool.elastic)
    ]
    _check_names(pools)
    for pool, adapter in launched:
        problems = adapter.validate(pool)
        if pool.roles and not adapter.supports_pd:
            problems.append(f"engine `{adapter.kind}` has no prefill/decode disaggregation")
        sleep = sleep_problem(pool)
        if sleep is not None:
            problems.append(sleep)
        if problems:
            raise PlanError(f"pool {pool.name!r} ({adapter.kind}): " + "; ".join(problems))

    devices = _allocate_devices(launched, settings, detect)
    book = PortBook(port_is_free)
    # Explicit ports first, so automatic ones never collide with them.
    for pool, adapter in launched:
        for k, (role, index) in enumerate(replica_slots(pool)):
            owner = f"pool {pool.name!r} replica {role.value}-{index}"
            if pool.port_base is not None:
                book.claim(pool.port_base + k, owner)
            if pool.kv_events.enabled and adapter.kv_events_port_needed and pool.kv_events.port_base is not None:
                book.claim(pool.kv_events.port_base + k, owner + " KV events")

    planned: list[PlannedReplica] = []
    for pool, adapter in launched:
        store = _plan_store(pool, adapter, settings, book)
        for k, (role, index) in enumerate(replica_slots(pool)):
            owner = f"pool {pool.name!r} replica {role.value}-{index}"
            port = pool.port_base + k if pool.port_base is not None else book.take(settings.port_base, pool.host, owner)
            events_port = None
            if pool.kv_events.enabled and adapter.kv_events_port_needed:
                events_port = (
                    pool.kv_events.port_base + k
                    if pool.kv_events.port_base is not None
                    else book.take(settings.kv_events_port_base, pool.host, owner + " KV events")
                )
            replay_port = None
            if events_port is not None and pool.kv_events.replay:
                replay_port = book.take(settings.kv_events_replay_port_base, pool.host, owner + " KV-event replay")
            transfer_port = None
            if adapter.kv_transfer_port_needed and (role is not Role.BOTH or pool.kv_transfer is not None):
                transfer_port = book.take(settings.kv_transfer_port_base, pool.host, owner + " KV transfer")
            pool_devices = devices.get(pool.name)
            replica = ReplicaPlan(
                pool=pool.name,
                role=role,
                index=index,
                host=pool.host,
                port=port,
                devices=pool_devices[k] if pool_devices else (),
                kv_events_port=events_port,
                kv_events_replay_port=replay_port,
                kv_transfer_port=transfer_port,
                log_path=os.path.join(settings.log_dir, f"{pool.name}.{role.value}-{index}.log"),
                run_dir=settings.run_dir,
                hash_seed=settings.hash_seed,
                kv_store_url=store.url if store is not None else None,
            )
            planned.append(PlannedReplica(pool, adapter, replica, launch_spec(adapter, pool, replica), store))
    return planned


def _plan_store(
    pool: PoolConfig, adapter: EngineAdapter, settings: BackendsSettings, book: PortBook
) -> PlannedStore | None:
    """The simulated KV store of a `sim` pool that declares `kv_store` (module doc), else None."""
    config = pool.kv_store
    if config is None or adapter.kind != "sim":
        return None
    # Bound where only the pool's replicas (launched on this host) reach it: the store is a test
    # double's side channel with no key (sim/kv_store.py), so a wildcard host is not passed on.
    host = "127.0.0.1" if pool.host in ("0.0.0.0", "::", "") else pool.host
    port = book.take(settings.port_base, host, f"pool {pool.name!r} KV store")
    argv = [sys.executable, "-m", "sim", "store", "--host", host, "--port", str(port)]
    argv += ["--capacity-tokens", str(config.capacity_tokens), "--bandwidth-gbps", repr(config.bandwidth_gbps)]
    argv += ["--latency-ms", repr(config.latency_ms)]
    if pool.preset is not None:
        argv += ["--preset", pool.preset]
    if pool.block_size is not None:
        argv += ["--block-size", str(pool.block_size)]
    log_path = os.path.join(settings.log_dir, f"{pool.name}.kv-store.log")
    url = f"http://{host}:{port}"
    return PlannedStore(pool.name, url, LaunchSpec(argv=tuple(argv), log_path=log_path))


def launch_spec(adapter: EngineAdapter, pool: PoolConfig, replica: ReplicaPlan) -> LaunchSpec:
    """The adapter's process for `replica`, with sleep mode switched on where the pool sleeps."""
    return with_sleep_mode(adapter.launch_spec(pool, replica), pool)


def device_inventory(
    pools: Sequence[PoolConfig], settings: BackendsSettings, detect: InventoryProbe = detect_devices
) -> tuple[tuple[int, ...] | None, str]:
    """This host's devices for the pools' engines (`backends.devices`, else the first engine's tool)
    and where the list came from (for messages)."""
    if settings.devices != "auto":
        return tuple(settings.devices), "backends.devices"
    adapters = [get_adapter(pool.engine) for pool in pools]
    tools = [a.device_tool for p, a in zip(pools, adapters, strict=True) if p.devices == "auto" and a.device_tool]
    tool = tools[0] if tools else next((a.device_tool for a in adapters if a.launches and a.device_tool), None)
    return (detect(tool) if tool else None), (f"this host ({tool})" if tool else "this host")


def _check_names(pools: Sequence[PoolConfig]) -> None:
    seen: set[str] = set()
    for pool in pools:
        if pool.name in seen:
            raise PlanError(f"pool {pool.name!r}: two pools share this name")
        seen.add(pool.name)


def _allocate_devices(
    launched: Sequence[tuple[PoolConfig, EngineAdapter]], settings: BackendsSettings, detect: InventoryProbe
) -> dict[str, list[tuple[int, ...]]]:
    requests = []
    elastic: set[int] = set()  # devices listed by autoscaled pools: theirs, given at each launch
    for pool, _adapter in launched:
        if pool.devices is None:
            continue
        explicit = None if pool.devices == "auto" else tuple(pool.devices)
        if pool.elastic:
            elastic.update(explicit or ())
            continue
        requests.append(
            DeviceRequest(
                pool=pool.name,
                replicas=pool.launched_replicas,
                per_replica=pool.tensor_parallel * pool.pipeline_parallel,
                devices=explicit,
                parallel_desc=f"TP {pool.tensor_parallel} x PP {pool.pipeline_parallel}",
            )
        )
    if not requests:
        return {}
    inventory, source = device_inventory([pool for pool, _ in launched], settings, detect)
    if inventory is not None and elastic:
        inventory = tuple(d for d in inventory if d not in elastic)
    return allocate_devices(requests, inventory, source)


def render_plan(
    pools: Sequence[PoolConfig], settings: BackendsSettings, *, detect: InventoryProbe = detect_devices
) -> str:
    """The exact command line and environment of every replica, as `tokenway pools plan` prints it.

    Nothing is launched and ports are assumed free (at launch an automatic port that is in use is
    skipped). Secrets in the environment are shown as <redacted>.
    """
    planned = plan_replicas(pools, settings, detect=detect)
    by_pool: dict[str, list[PlannedReplica]] = {}
    for item in planned:
        by_pool.setdefault(item.pool.name, []).append(item)
    devices = (
        "auto (nvidia-smi / npu-smi, asked only for pools with `devices: auto`)"
        if settings.devices == "auto"
        else str(list(settings.devices))
    )
    lines = [
        "# tokenway pools plan: nothing is launched.",
        f"# host devices: {devices}; automatic ports from {settings.port_base} (busy ones are skipped "
        "at launch); each replica inherits the gateway's environment plus the variables shown.",
    ]
    for pool in pools:
        adapter = get_adapter(pool.engine)
        lines.append("")
        lines.append(
            f"pool {pool.name}: model {pool.model!r}, engine {pool.engine}, "
            f"{pool.launched_replicas} launched, {len(pool.endpoints)} static, "
            f"TP {pool.tensor_parallel} x PP {pool.pipeline_parallel}"
        )
        items = by_pool.get(pool.name, [])
        store = items[0].store if items else None
        if store is not None:
            lines.append(
                f"  {pool.name}/kv-store: {store.url}  log {store.spec.log_path} (the replicas' shared KV store)"
            )
            lines.append(f"    {shlex.join(store.spec.argv)}")
        for item in items:
            lines += _render_replica(item)
        for i, static in enumerate(pool.endpoints):
            lines.append(f"  {pool.name}/{static.role.value}-s{i}: {static.url} (static, not launched)")
        if by_pool.get(pool.name) and pool.devices is None and adapter.uses_devices:
            lines.append(
                "  note: `devices` not set: devices are not managed, every replica sees all of the host's devices"
            )
    return "\n".join(lines) + "\n"


def _render_replica(item: PlannedReplica) -> list[str]:
    replica, spec = item.replica, item.spec
    head = f"  {replica.endpoint_id}: {replica.base_url}"
    if replica.devices:
        head += f"  devices {','.join(map(str, replica.devices))}"
    events = item.adapter.kv_events_endpoint(item.pool, replica)
    if events:
        head += f"  kv-events {events}"
    replay = item.adapter.kv_events_replay_endpoint(item.pool, replica)
    if replay:
        head += f" (replay {replay})"
    head += f"  log {spec.log_path}"
    env = " ".join(
        f"{name}={'<redacted>' if name in spec.secret_env else shlex.quote(value)}" for name, value in spec.env.items()
    )
    command = shlex.join(spec.argv)
    lines = [head, f"    {'env ' + env + ' ' if env else ''}{command}"]
    for path, content in spec.files.items():
        lines.append(f"    file {path}:")
        lines += [f"      {line}" for line in content.rstrip("\n").splitlines()]
    return lines
