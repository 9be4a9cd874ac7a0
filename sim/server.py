"""Start simulated engines: in the running event loop (one engine + one HTTP site per instance), or
from the command line as a drop-in for `vllm serve` (`main`).

In-process use (tests, benchmarks)::

    async with run_sim_instances("llama-3.1-8b@h100", count=2, time_scale=10) as urls:
        ...  # urls == ["http://127.0.0.1:PORT0", "http://127.0.0.1:PORT1"]

Keyword arguments other than the ones named below go to `build_engine_config` (max_num_seqs,
num_gpu_blocks_override, kv_events_config, ...). Ports are free ones unless `port` is given, in which
case instance i listens on port + i. Sockets are bound first and only listen once the engine runs,
so a client sees "connection refused" until the instance is ready, as with vLLM.

The command line
----------------
`tokenway sim` / `python -m sim`: a drop-in for `vllm serve` backed by the simulator.

Accepts what the vLLM adapter passes (``[serve] [MODEL] --host H --port P --served-model-name NAME
--max-model-len N --block-size 16 --gpu-memory-utilization 0.9 --enable-prefix-caching -tp 1
--kv-events-config JSON --kv-transfer-config JSON --api-key KEY ...``); other flags, with or without
values, are ignored with one log line. MODEL may be a preset (``llama-3.1-70b-tp4@h100``); otherwise
it is only the model id, and the preset comes from ``--preset``, ``$TOKENWAY_SIM_PRESET`` or the
default.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import socket
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import web

from backends.perf import roofline
from backends.perf.presets import DEFAULT_PRESET, is_preset_name, preset_names
from sim.config import VLLM_VERSION, EngineConfig, build_engine_config
from sim.engine import SimEngine
from sim.http_api import build_app
from sim.kv_store import main as store_main

log = logging.getLogger("tokenway.sim")


@dataclass(slots=True)
class SimInstance:
    engine: SimEngine
    runner: web.AppRunner
    host: str
    port: int

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "", "::") else self.host
        return f"http://{host}:{self.port}"


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.setblocking(False)
    return sock


async def start_instance(config: EngineConfig, host: str = "127.0.0.1", port: int = 0, index: int = 0) -> SimInstance:
    """Bind, come up (`config.startup_s` simulated seconds: weights and initialisation), start the
    engine, then listen. The caller owns `stop_instance`."""
    sock = _bind(host, port)
    try:
        if config.startup_s > 0:
            log.info("loading %s: ready in %.1f s simulated", config.preset.name, config.startup_s)
            await asyncio.sleep(config.startup_s / config.time_scale)
        bound_port = sock.getsockname()[1]
        engine = SimEngine(config, instance_index=index)
        engine.advertised_host = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
        engine.advertised_port = bound_port
        await engine.start()
        try:
            runner = web.AppRunner(build_app(engine), handler_cancellation=True, access_log=None)
            await runner.setup()
            site = web.SockSite(runner, sock)
            await site.start()
        except BaseException:
            await engine.stop()
            raise
    except BaseException:
        sock.close()
        raise
    return SimInstance(engine, runner, host, bound_port)


async def stop_instance(instance: SimInstance) -> None:
    await instance.runner.cleanup()
    await instance.engine.stop()


async def start_instances(
    config: EngineConfig, count: int, host: str = "127.0.0.1", port: int = 0
) -> list[SimInstance]:
    """Start `count` engines side by side (their start-ups overlap, as separate processes' would)."""
    configs = [
        replace(config) if i == 0 else replace(config, engine_id=f"{config.engine_id}-{i}") for i in range(count)
    ]
    tasks = [asyncio.ensure_future(start_instance(c, host, port + i if port else 0, i)) for i, c in enumerate(configs)]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for task in tasks:
            if not task.cancelled() and task.exception() is None:
                await stop_instance(task.result())
        raise


@contextlib.asynccontextmanager
async def run_sim_instances(
    preset: str = "llama-3.1-8b@h100",
    count: int = 1,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    time_scale: float = 1.0,
    **engine_overrides: Any,
) -> AsyncIterator[list[str]]:
    """Run `count` engines in this loop for the duration of the block; yields their base URLs."""
    config = build_engine_config(preset, time_scale=time_scale, **engine_overrides)
    instances = await start_instances(config, count, host, port)
    try:
        yield [instance.url for instance in instances]
    finally:
        for instance in instances:
            await stop_instance(instance)


@contextlib.asynccontextmanager
async def run_sim_engines(
    preset: str = "llama-3.1-8b@h100", count: int = 1, **kwargs: Any
) -> AsyncIterator[list[SimInstance]]:
    """Like run_sim_instances, but yields the instances (engine objects included) for white-box use."""
    host = kwargs.pop("host", "127.0.0.1")
    port = kwargs.pop("port", 0)
    config = build_engine_config(preset, **kwargs)
    instances = await start_instances(config, count, host, port)
    try:
        yield instances
    finally:
        for instance in instances:
            await stop_instance(instance)


async def serve_forever(config: EngineConfig, count: int, host: str, port: int, startup_delay_s: float = 0.0) -> None:
    """The CLI's main: optional startup delay, start, print readiness, run until cancelled."""
    if startup_delay_s > 0:
        await asyncio.sleep(startup_delay_s)
    instances = await start_instances(config, count, host, port)
    for instance in instances:
        print(f"tokenway-sim ready on http://{instance.host}:{instance.port}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        for instance in instances:
            await stop_instance(instance)


# --- the command line -----------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tokenway sim",
        description="Simulated vLLM engine: vLLM's API and scheduling, a performance model for a GPU.",
        epilog="Presets: MODEL[-tpN]@HW, e.g. " + ", ".join(preset_names()[:4]) + ", ...",
    )
    p.add_argument("--preset", default=None, help=f"MODEL[-tpN]@HW (default {DEFAULT_PRESET})")
    p.add_argument("--model", default=None, help="model id (default: the preset's HF id)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.92)
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--kv-events-config", default=None, help="vLLM KVEventsConfig JSON")
    p.add_argument(
        "--kv-events-format",
        choices=("tagged", "positional"),
        default=None,
        help="event shape: vLLM 0.33 tagged maps (default) or older positional arrays",
    )
    p.add_argument("--kv-transfer-config", default=None, help="vLLM KVTransferConfig JSON")
    p.add_argument("-tp", "--tensor-parallel-size", dest="tp", type=int, default=None)
    p.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--instances", type=int, default=1, help="engines on ports P..P+N-1")
    p.add_argument("--time-scale", type=float, default=1.0, help="simulated seconds per real second")
    p.add_argument(
        "--kv-transfer-bandwidth-gbps", type=float, default=25.0, help="PD link bandwidth in GB/s for KV pulls"
    )
    p.add_argument(
        "--kv-store-url",
        default=None,
        help="a KV store shared with other engines (`python -m sim store`): computed blocks are written to it, "
        "a prefix's continuation there is loaded instead of recomputed",
    )
    p.add_argument("--topology", default=None, help="where this engine sits: node=N,rack=R,zone=Z (any of them)")
    p.add_argument(
        "--kv-link-gbps",
        default=None,
        help="GB/s of a PD pull per link class to the prefill engine's labels: same_node=..,same_rack=..,"
        "cross_rack=..,cross_zone=.. (unnamed classes: --kv-transfer-bandwidth-gbps)",
    )
    p.add_argument(
        "--kv-offloading-size", type=float, default=None, help="GiB of host DRAM per engine for offloaded KV (vLLM's)"
    )
    p.add_argument(
        "--kv-offload-bandwidth-gbps", type=float, default=25.0, help="host DRAM <-> HBM bandwidth in GB/s (PCIe)"
    )
    p.add_argument(
        "--output-len-mean", type=float, default=200.0, help="mean of the natural output length when ignore_eos is off"
    )
    p.add_argument(
        "--embedding-dim",
        type=int,
        default=256,
        help="length of /v1/embeddings vectors when a request names no dimensions",
    )
    p.add_argument(
        "--startup-delay-s", type=float, default=0.0, help="real seconds to wait before listening (readiness tests)"
    )
    p.add_argument(
        "--simulate-startup",
        action="store_true",
        help="listen only after loading the weights at the load bandwidth plus --init-s (simulated seconds)",
    )
    p.add_argument(
        "--load-bandwidth-gbps",
        type=float,
        default=None,
        help=f"GB/s from storage for start-up and level-2 wake-ups (default {roofline.DEFAULT_LOAD_BANDWIDTH / 1e9:g})",
    )
    p.add_argument(
        "--init-s", type=float, default=None, help=f"start-up beyond the weights (default {roofline.DEFAULT_INIT_S:g})"
    )
    p.add_argument("--load-format", default="auto", help="vLLM's; 'dummy' loads no weights (start-up is init only)")
    p.add_argument(
        "--fail-on-marker",
        default=None,
        help="tests only: a generation request whose body holds this text answers 500 (GET /internal/faults counts)",
    )
    p.add_argument(
        "--enable-sleep-mode",
        action="store_true",
        help="vLLM's sleep mode; /sleep, /wake_up, /is_sleeping also need VLLM_SERVER_DEV_MODE=1",
    )
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (sim/lora.py)")
    p.add_argument("--max-loras", type=int, default=1, help="adapters per batch and on the GPU (vLLM's)")
    p.add_argument("--lora-modules", nargs="+", default=None, help="NAME=PATH adapters registered at start")
    p.add_argument(
        "--lora-load-bandwidth-gbps", type=float, default=1.0, help="GB/s at which an adapter loads onto the GPU"
    )
    p.add_argument(
        "--lora-memory-budget-mb",
        type=float,
        default=None,
        help="MB of adapters on the GPU besides --max-loras (the gateway's lora_memory_budget_mb); default: none",
    )
    p.add_argument("--log-level", default="INFO")
    return p


def split_known(argv: list[str], parser: argparse.ArgumentParser) -> tuple[list[str], list[str], list[str]]:
    """(positionals, known flag tokens, ignored tokens).

    Positionals are only taken before the first flag (``serve MODEL``). An unknown flag swallows the
    non-flag tokens after it (its values), so ``--lora-modules a=b c=d`` is ignored whole.
    """
    option_strings = {s for action in parser._actions for s in action.option_strings}
    flags_with_values = {s for action in parser._actions if action.nargs != 0 for s in action.option_strings}
    positionals: list[str] = []
    known: list[str] = []
    ignored: list[str] = []
    i = 0
    while i < len(argv) and not argv[i].startswith("-"):
        positionals.append(argv[i])
        i += 1
    while i < len(argv):
        token = argv[i]
        name = token.split("=", 1)[0]
        if name in option_strings:
            known.append(token)
            i += 1
            if name in flags_with_values and "=" not in token:
                while i < len(argv) and (not argv[i].startswith("-") or _is_number(argv[i])):
                    known.append(argv[i])
                    i += 1
            continue
        ignored.append(token)
        i += 1
        if "=" not in token:
            while i < len(argv) and (not argv[i].startswith("-") or _is_number(argv[i])):
                ignored.append(argv[i])
                i += 1
    return positionals, known, ignored


def _lora_modules(specs: list[str] | None) -> dict[str, str]:
    """vLLM's `--lora-modules name=path ...` (the JSON form is not modelled)."""
    modules: dict[str, str] = {}
    for spec in specs or ():
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules expects NAME=PATH, got {spec!r}")
        modules[name] = path
    return modules


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["store"]:  # the KV store shared by engine processes (sim/kv_store.py)
        return store_main(argv[1:])
    parser = _parser()
    if any(a in ("-h", "--help") for a in argv):
        parser.print_help()
        return 0
    positionals, known, ignored = split_known(argv, parser)
    args = parser.parse_args(known)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    if ignored:
        log.info("tokenway-sim ignores vLLM flags it does not model: %s", " ".join(ignored))
    if positionals and positionals[0] == "serve":
        positionals = positionals[1:]
    model_arg = positionals[0] if positionals else args.model
    if model_arg and is_preset_name(model_arg):
        preset, model_id = model_arg, args.model
    else:
        preset = args.preset or os.environ.get("TOKENWAY_SIM_PRESET") or DEFAULT_PRESET
        model_id = model_arg
    events = args.kv_events_config
    if events is not None and args.kv_events_format:
        data = json.loads(events)
        data["format"] = args.kv_events_format
        events = json.dumps(data)
    try:
        config = build_engine_config(
            preset,
            tp=args.tp,
            model=model_id,
            served_model_names=args.served_model_name,
            max_model_len=args.max_model_len,
            block_size=args.block_size,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            gpu_memory_utilization=args.gpu_memory_utilization,
            num_gpu_blocks_override=args.num_gpu_blocks_override,
            enable_prefix_caching=args.enable_prefix_caching,
            kv_events_config=events,
            kv_transfer_config=args.kv_transfer_config,
            seed=args.seed,
            output_len_mean=args.output_len_mean,
            time_scale=args.time_scale,
            kv_transfer_bandwidth_gbps=args.kv_transfer_bandwidth_gbps,
            topology=args.topology,
            kv_link_bandwidth_gbps=args.kv_link_gbps,
            kv_offloading_size_gib=args.kv_offloading_size,
            kv_offload_bandwidth_gbps=args.kv_offload_bandwidth_gbps,
            kv_store_url=args.kv_store_url,
            api_key=args.api_key,
            embedding_dim=args.embedding_dim,
            fail_on_marker=args.fail_on_marker,
            enable_sleep_mode=args.enable_sleep_mode,
            simulate_startup=args.simulate_startup,
            load_bandwidth_gbps=args.load_bandwidth_gbps,
            init_s=args.init_s,
            load_format=args.load_format,
            enable_lora=args.enable_lora,
            max_loras=args.max_loras,
            lora_modules=_lora_modules(args.lora_modules),
            lora_load_bandwidth_gbps=args.lora_load_bandwidth_gbps,
            lora_memory_budget_mb=args.lora_memory_budget_mb,
        )
    except ValueError as exc:
        log.error("cannot start: %s", exc)
        return 1
    log.info(
        "tokenway-sim (vLLM %s API) preset %s: %d KV blocks of %d tokens, max_model_len %d, "
        "max_num_seqs %d, max_num_batched_tokens %d, time scale %g",
        VLLM_VERSION,
        config.preset.name,
        config.num_gpu_blocks,
        config.block_size,
        config.max_model_len,
        config.max_num_seqs,
        config.max_num_batched_tokens,
        config.time_scale,
    )
    with contextlib.suppress(ImportError):  # pragma: no cover - uvloop is a dependency on Linux
        import uvloop

        uvloop.install()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve_forever(config, args.instances, args.host, args.port, args.startup_delay_s))
    return 0
