"""Start-up time of the simulated engine: weights over the load bandwidth plus initialisation."""

from __future__ import annotations

import asyncio
import socket

import pytest

from backends.perf import roofline
from backends.perf.presets import resolve_preset
from backends.perf.roofline import weight_bytes_per_device
from sim.config import build_engine_config
from sim.server import _parser, split_known, start_instance, stop_instance
from tests.support.procs import free_port

H100_8B = resolve_preset("llama-3.1-8b@h100")


def test_startup_is_weights_over_load_bandwidth_plus_init() -> None:
    weights = H100_8B.model.weight_bytes
    assert roofline.startup_s(H100_8B) == pytest.approx(weights / 2e9 + 5.0)
    assert roofline.startup_s(H100_8B, load_bandwidth=4e9, init_s=1.0) == pytest.approx(weights / 4e9 + 1.0)
    assert roofline.startup_s(H100_8B, load_weights=False) == pytest.approx(5.0)
    seventy = resolve_preset("llama-3.1-70b-tp4@h100")
    assert roofline.startup_s(seventy) > roofline.startup_s(H100_8B)
    with pytest.raises(ValueError):
        roofline.startup_s(H100_8B, load_bandwidth=0)


def test_sleep_and_wake_times() -> None:
    pcie = H100_8B.hardware.pcie_bandwidth * roofline.PCIE_EFFICIENCY
    assert roofline.sleep_s(H100_8B, 1) == pytest.approx(weight_bytes_per_device(H100_8B) / pcie)
    assert roofline.wake_s(H100_8B, 1) == roofline.sleep_s(H100_8B, 1)
    assert roofline.sleep_s(H100_8B, 2) == 0.0
    assert roofline.wake_s(H100_8B, 2) == pytest.approx(roofline.weight_load_s(H100_8B))
    assert roofline.wake_s(H100_8B, 1) < roofline.wake_s(H100_8B, 2) < roofline.startup_s(H100_8B)
    # TP ranks copy their shards in parallel: a TP-4 wake moves a quarter per link
    tp4 = resolve_preset("llama-3.1-8b-tp4@h100")
    assert roofline.wake_s(tp4, 1) == pytest.approx(roofline.wake_s(H100_8B, 1) / 4, rel=1e-3)
    with pytest.raises(ValueError):
        roofline.wake_s(H100_8B, 3)


def test_config_models_startup_only_when_asked() -> None:
    assert build_engine_config("llama-3.1-8b@h100").startup_s == 0.0
    config = build_engine_config("llama-3.1-8b@h100", simulate_startup=True, load_bandwidth_gbps=4.0, init_s=2.0)
    assert config.startup_s == pytest.approx(roofline.startup_s(H100_8B, 4e9, 2.0))
    assert config.load_bandwidth == 4e9
    dummy = build_engine_config("llama-3.1-8b@h100", simulate_startup=True, load_format="dummy")
    assert dummy.startup_s == pytest.approx(roofline.DEFAULT_INIT_S)
    with pytest.raises(ValueError):
        build_engine_config("llama-3.1-8b@h100", load_bandwidth_gbps=0.0)


def test_cli_flags() -> None:
    argv = ["serve", "llama-3.1-8b@h100", "--simulate-startup", "--load-bandwidth-gbps", "3", "--init-s", "1.5"]
    argv += ["--load-format", "dummy", "--enable-sleep-mode"]
    _positionals, known, ignored = split_known(argv, _parser())
    assert not ignored
    args = _parser().parse_args(known)
    assert args.simulate_startup and args.enable_sleep_mode
    assert (args.load_bandwidth_gbps, args.init_s, args.load_format) == (3.0, 1.5, "dummy")


def _refused(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.connect(("127.0.0.1", port))
        except ConnectionRefusedError:
            return True
    return False


async def test_connections_are_refused_while_loading_and_cancelling_frees_the_port() -> None:
    # 16 GB at 2 GB/s + 5 s = 13 simulated seconds at time scale 0.01: far longer than the test
    config = build_engine_config("llama-3.1-8b@h100", simulate_startup=True, time_scale=0.01)
    port = free_port()
    starting = asyncio.ensure_future(start_instance(config, port=port))
    for _ in range(100):  # let it bind
        await asyncio.sleep(0)
    assert not starting.done()
    assert _refused(port)
    starting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await starting
    with socket.socket() as s:  # the bound socket was closed
        s.bind(("127.0.0.1", port))


async def test_a_loading_engine_serves_once_up() -> None:
    config = build_engine_config("llama-3.1-8b@h100", simulate_startup=True, time_scale=1000.0)
    instance = await start_instance(config)
    try:
        assert not _refused(instance.port)
    finally:
        await stop_instance(instance)
