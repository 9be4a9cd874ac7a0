"""Discovery against a fake API server speaking the list+watch protocol (tests/support/fake_kube.py),
through the official `kubernetes` client in its thread: lists, chunked watch events, bookmarks,
410 Gone (as an event and as a status) -> relist, lost connections, an API server that is not
there yet, drains of endpoints with requests on them."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from backends.config import PoolConfig
from backends.discovery.service import PoolDiscovery
from backends.discovery.slices import KubernetesDiscoveryConfig
from backends.fleet import Pool
from backends.types import EndpointState, Topology
from tests.support.fake_kube import FakeKubeApi, endpoint_slice
from tests.support.polling import wait_for_async


@pytest.fixture
def api() -> Iterator[FakeKubeApi]:
    with FakeKubeApi() as fake:
        yield fake


def _config(api: FakeKubeApi, **extra: object) -> KubernetesDiscoveryConfig:
    return KubernetesDiscoveryConfig.model_validate(
        {
            "namespace": "default",
            "service": "engines",
            "port": "http",
            "api_server": api.url,
            "retry_backoff_s": 0.05,
            "retry_backoff_max_s": 0.2,
            "drain_timeout_s": 30,
            **extra,
        }
    )


def _pool(config: KubernetesDiscoveryConfig) -> Pool:
    return Pool(
        PoolConfig.model_validate(
            {"name": "p", "model": "m", "engine": "vllm", "discovery": {"kubernetes": config.model_dump()}}
        )
    )


def _urls(pool: Pool) -> dict[str, str]:
    return {e.base_url: e.state.value for e in pool.endpoints}


async def _discover(config: KubernetesDiscoveryConfig) -> tuple[Pool, PoolDiscovery, list[int]]:
    pool = _pool(config)
    changes: list[int] = []
    discovery = PoolDiscovery(pool, config, lambda p: changes.append(len(p.endpoints)))
    await discovery.start()
    return pool, discovery, changes


@pytest.mark.slow
async def test_list_then_watch_adds_and_removes_endpoints(api: FakeKubeApi) -> None:
    api.upsert(endpoint_slice("engines-a", "engines", [("10.0.0.1", "pod-1")], port=8000))
    api.upsert(endpoint_slice("other-a", "other", [("10.0.9.9", "pod-x")], port=8000))  # another Service
    pool, discovery, changes = await _discover(_config(api))
    try:
        await wait_for_async(lambda: discovery.synced and bool(pool.endpoints))
        assert _urls(pool) == {"http://10.0.0.1:8000": "starting"}  # health-checked before use
        assert pool.endpoints[0].id == "p/pod-1"
        api.upsert(endpoint_slice("engines-b", "engines", [("10.0.0.2", "pod-2"), ("10.0.0.3", None)], port=8000))
        await wait_for_async(lambda: len(pool.endpoints) == 3)
        assert {e.id for e in pool.endpoints} == {"p/pod-1", "p/pod-2", "p/10.0.0.3:8000"}
        # a pod whose readiness fails leaves at once (no requests on it here)
        api.upsert(endpoint_slice("engines-b", "engines", [("10.0.0.2", "pod-2")], port=8000))
        await wait_for_async(lambda: len(pool.endpoints) == 2)
        api.delete("engines-a")
        await wait_for_async(lambda: _urls(pool) == {"http://10.0.0.2:8000": "starting"})
        assert api.lists == 1  # one list, then only watching
        assert changes  # the gateway was told of every change
    finally:
        await discovery.stop()


@pytest.mark.slow
async def test_bookmarks_move_the_watch_on_without_a_relist(api: FakeKubeApi) -> None:
    api.upsert(endpoint_slice("engines-a", "engines", [("10.0.0.1", "pod-1")], port=8000))
    pool, discovery, _ = await _discover(_config(api))
    try:
        await wait_for_async(lambda: bool(pool.endpoints))
        listed_at = int(api.watch_versions[0]) if api.watch_versions else 0
        api.upsert(endpoint_slice("other-a", "other", [("10.0.9.9", None)], port=8000))  # not ours: version moves
        moved_to = api.version
        # the client hears of the new version only by bookmark; the stream delivers what was written
        # before it ends, so dropping it after a bookmark was sent is no race
        await wait_for_async(lambda: any(v >= moved_to for v in api.bookmarks_sent))
        api.drop_watches()  # the connection is lost: the next watch must start where the bookmark said
        await wait_for_async(lambda: len(api.watch_versions) >= 2)
        assert int(api.watch_versions[-1]) >= moved_to > listed_at
        assert api.lists == 1
        api.upsert(endpoint_slice("engines-b", "engines", [("10.0.0.2", "pod-2")], port=8000))
        await wait_for_async(lambda: len(pool.endpoints) == 2)
    finally:
        await discovery.stop()


@pytest.mark.parametrize("as_status", [False, True], ids=["gone-event", "gone-status"])
async def test_gone_relists_and_converges(as_status: bool) -> None:
    with FakeKubeApi(gone_as_status=as_status) as api:
        api.upsert(endpoint_slice("engines-a", "engines", [("10.0.0.1", "pod-1")], port=8000))
        pool, discovery, _ = await _discover(_config(api))
        try:
            await wait_for_async(lambda: bool(pool.endpoints))
            api.compact()  # the watch ends with 410 (or the next watch is refused with it)
            # changes while the client relists are not lost: the fresh list holds them
            api.delete("engines-a")
            api.upsert(endpoint_slice("engines-c", "engines", [("10.0.0.5", "pod-5")], port=8000))
            await wait_for_async(lambda: api.lists >= 2 and _urls(pool) == {"http://10.0.0.5:8000": "starting"})
            assert discovery.status()["relists"] == 1 and api.lists == 2  # one 410, one fresh list
        finally:
            await discovery.stop()


@pytest.mark.slow
async def test_vanished_endpoint_drains_its_requests_first(api: FakeKubeApi) -> None:
    api.upsert(endpoint_slice("engines-a", "engines", [("10.0.0.1", "pod-1")], port=8000))
    pool, discovery, _ = await _discover(_config(api))
    try:
        await wait_for_async(lambda: bool(pool.endpoints))
        endpoint = pool.endpoints[0]
        endpoint.state = EndpointState.READY  # as the health check would
        ticket = endpoint.inflight.begin(100)  # a request in flight on it
        api.delete("engines-a")
        await wait_for_async(lambda: endpoint.state is EndpointState.DRAINING)
        await asyncio.sleep(0.2)
        assert endpoint in pool.endpoints  # still there while its request runs
        assert not pool.servable()  # but takes nothing new
        ticket.end()
        await wait_for_async(lambda: endpoint not in pool.endpoints)
        # back again later: a new endpoint, health-checked again
        api.upsert(endpoint_slice("engines-a", "engines", [("10.0.0.1", "pod-1")], port=8000))
        await wait_for_async(lambda: _urls(pool) == {"http://10.0.0.1:8000": "starting"})
    finally:
        await discovery.stop()


@pytest.mark.slow
async def test_an_endpoint_that_comes_back_while_draining_is_checked_again(api: FakeKubeApi) -> None:
    api.upsert(endpoint_slice("engines-a", "engines", [("10.0.0.1", "pod-1")], port=8000))
    pool, discovery, _ = await _discover(_config(api))
    try:
        await wait_for_async(lambda: bool(pool.endpoints))
        endpoint = pool.endpoints[0]
        endpoint.state = EndpointState.READY
        ticket = endpoint.inflight.begin(0)
        api.upsert(endpoint_slice("engines-a", "engines", [("10.0.0.1", "pod-1")], port=8000, ready=False))
        await wait_for_async(lambda: endpoint.state is EndpointState.DRAINING)
        api.upsert(endpoint_slice("engines-a", "engines", [("10.0.0.1", "pod-1")], port=8000))
        await wait_for_async(lambda: endpoint.state is EndpointState.STARTING)
        ticket.end()
        await asyncio.sleep(0.2)
        assert pool.endpoints == [endpoint]
    finally:
        await discovery.stop()


async def test_an_api_server_that_is_not_up_yet_is_retried(tmp_path: Path) -> None:
    api = FakeKubeApi()
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    pool, discovery, _ = await _discover(_config(api, token_file=str(token)))
    try:
        await wait_for_async(lambda: discovery.last_failure is not None)
        api.start()
        api.upsert(endpoint_slice("engines-a", "engines", [("10.0.0.1", "pod-1")], port=8000))
        await wait_for_async(lambda: bool(pool.endpoints))
        assert api.authorizations == {"Bearer s3cret"}
    finally:
        await discovery.stop()
        api.stop()


async def test_many_slices_are_listed_page_by_page(api: FakeKubeApi) -> None:
    for i in range(12):
        api.upsert(endpoint_slice(f"engines-{i:02d}", "engines", [(f"10.0.1.{i}", f"pod-{i}")], port=8000))
    from backends.discovery import kubernetes

    old, kubernetes.LIST_PAGE = kubernetes.LIST_PAGE, 5
    try:
        pool, discovery, _ = await _discover(_config(api))
        try:
            await wait_for_async(lambda: len(pool.endpoints) == 12)
            assert api.lists == 3
        finally:
            await discovery.stop()
    finally:
        kubernetes.LIST_PAGE = old


async def test_stop_ends_the_watch_thread_promptly(api: FakeKubeApi) -> None:
    api.bookmark_interval_s = 3600  # a silent server: the thread sits in a blocking read
    before = set(threading.enumerate())
    pool, discovery, _ = await _discover(_config(api))
    await wait_for_async(lambda: discovery.synced and api.open_watches() == 1)
    (watcher,) = [t for t in set(threading.enumerate()) - before if t.name.startswith("k8s-watch")]
    await discovery.stop()  # closes the blocked read; the join is bounded either way
    assert not watcher.is_alive()
    del pool


def _on_node(obj: dict[str, object], *nodes: str) -> dict[str, object]:
    for endpoint, node in zip(obj["endpoints"], nodes, strict=True):  # type: ignore[call-overload]
        endpoint.update({"nodeName": node, "zone": "z1"})
    return obj


@pytest.mark.slow
async def test_rack_label_is_read_once_per_node_and_reaches_the_topology(api: FakeKubeApi) -> None:
    api.nodes = {"gpu-1": {"example.com/rack": "r1"}, "gpu-2": {"example.com/rack": "r2"}}
    api.upsert(_on_node(endpoint_slice("engines-a", "engines", [("10.0.0.1", "pod-1"), ("10.0.0.2", "pod-2")],
                                       port=8000), "gpu-1", "gpu-1"))  # fmt: skip
    pool, discovery, _ = await _discover(_config(api, rack_label="example.com/rack"))
    try:
        await wait_for_async(lambda: len(pool.endpoints) == 2)
        assert {e.topology for e in pool.endpoints} == {Topology(node="gpu-1", rack="r1", zone="z1")}
        api.upsert(_on_node(endpoint_slice("engines-b", "engines", [("10.0.0.3", "pod-3"), ("10.0.0.4", "pod-4")],
                                           port=8000), "gpu-2", "gpu-9"))  # fmt: skip
        await wait_for_async(lambda: len(pool.endpoints) == 4)
        by_id = {e.id: e.topology for e in pool.endpoints}
        assert by_id["p/pod-3"] == Topology(node="gpu-2", rack="r2", zone="z1")
        assert by_id["p/pod-4"] == Topology(node="gpu-9", zone="z1")  # no such node: rack unknown
        assert sorted(api.node_reads) == ["gpu-1", "gpu-2", "gpu-9"]  # each node once
    finally:
        await discovery.stop()


async def test_without_a_rack_label_no_node_is_read(api: FakeKubeApi) -> None:
    api.upsert(_on_node(endpoint_slice("engines-a", "engines", [("10.0.0.1", "pod-1")], port=8000), "gpu-1"))
    pool, discovery, _ = await _discover(_config(api))
    try:
        await wait_for_async(lambda: len(pool.endpoints) == 1)
        assert pool.endpoints[0].topology == Topology(node="gpu-1", zone="z1")
        assert api.node_reads == []
    finally:
        await discovery.stop()


# What the API server sends is input (bench/chaos/control_fuzz.py).


def _hostile(name: str, **fields: object) -> dict[str, object]:
    obj = endpoint_slice(name, "engines", [("10.0.0.9", "pod-9")], port=8000)
    obj.update(fields)
    return obj


async def test_a_slice_of_the_wrong_shape_is_ignored_and_the_watch_goes_on(api: FakeKubeApi) -> None:
    """`ports: 5` once raised in the task applying the watch's events: it ended, and nothing the
    watch delivered afterwards reached the pool (while the thread went on queueing events)."""
    api.upsert(endpoint_slice("engines-a", "engines", [("10.0.0.1", "pod-1")], port=8000))
    pool, discovery, _ = await _discover(_config(api))
    try:
        await wait_for_async(lambda: bool(pool.endpoints))
        cases: list[dict[str, object]] = [{"ports": 5}, {"endpoints": 7}, {"endpoints": [{"conditions": []}]}]
        for i, fields in enumerate(cases):
            api.upsert(_hostile(f"engines-bad-{i}", **fields))
        api.upsert(endpoint_slice("engines-b", "engines", [("10.0.0.2", "pod-2")], port=8000))
        await wait_for_async(lambda: len(pool.endpoints) == 2)
        assert set(_urls(pool)) == {"http://10.0.0.1:8000", "http://10.0.0.2:8000"}
    finally:
        await discovery.stop()


async def test_a_list_that_pages_past_its_bound_is_refused_and_the_pool_kept(
    api: FakeKubeApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `continue` on every page once made the list collect items forever (memory without end)."""
    from backends.discovery import kubernetes

    for i in range(3):
        api.upsert(endpoint_slice(f"engines-{i}", "engines", [(f"10.0.1.{i}", f"pod-{i}")], port=8000))
    monkeypatch.setattr(kubernetes, "LIST_PAGE", 1)
    monkeypatch.setattr(kubernetes, "MAX_LIST_PAGES", 2)
    pool, discovery, _ = await _discover(_config(api))
    try:
        await wait_for_async(lambda: discovery.last_failure is not None)
        assert "still paging" in str(discovery.last_failure) and not pool.endpoints
    finally:
        await discovery.stop()


async def test_a_watch_refused_410_right_after_its_list_backs_off(api: FakeKubeApi) -> None:
    """An API server answering 410 to the version it has just listed once had the watch list again at
    once, forever: a loop as fast as the two could talk. It is now a failure, retried with backoff."""
    api.gone_as_status = True
    api.oldest_version = 10**9  # every watch is from a version too old
    api.upsert(endpoint_slice("engines-a", "engines", [("10.0.0.1", "pod-1")], port=8000))
    pool, discovery, _ = await _discover(_config(api))
    try:
        await wait_for_async(lambda: discovery.last_failure is not None and api.lists >= 2)
        assert "410" in str(discovery.last_failure)
        assert _urls(pool) == {"http://10.0.0.1:8000": "starting"}  # the list's slices are kept meanwhile
    finally:
        await discovery.stop()


class _Stream:
    def __init__(self, *chunks: bytes) -> None:
        self.chunks = chunks

    def stream(self, amt: int, decode_content: bool = True) -> Iterator[bytes]:
        yield from self.chunks


def test_watch_lines_are_bounded_and_a_cut_one_is_dropped() -> None:
    from backends.discovery.kubernetes import Unusable, lines_of

    assert list(lines_of(_Stream(b'{"a":', b"1}\n{}\n", b'{"cut'))) == [b'{"a":1}', b"{}"]
    with pytest.raises(Unusable, match="longer than"):
        list(lines_of(_Stream(b"x" * 1000, b"y" * 1000), limit=1500))


async def test_a_rack_label_that_is_no_label_value_is_unknown(api: FakeKubeApi) -> None:
    api.nodes = {"gpu-1": {"example.com/rack": "x" * 100}, "gpu-2": {"example.com/rack": "r 2"}}
    api.upsert(_on_node(endpoint_slice("engines-a", "engines", [("10.0.0.1", "pod-1"), ("10.0.0.2", "pod-2")],
                                       port=8000), "gpu-1", "gpu-2"))  # fmt: skip
    pool, discovery, _ = await _discover(_config(api, rack_label="example.com/rack"))
    try:
        await wait_for_async(lambda: len(pool.endpoints) == 2 and len(api.node_reads) == 2)
        await wait_for_async(lambda: all(e.topology.node for e in pool.endpoints))
        assert {e.topology.rack for e in pool.endpoints} == {None}
    finally:
        await discovery.stop()


class _Page(_Stream):
    """A list page as the client library returns it: `read_bounded` hands its connection back, and
    a page held in memory has none to hand back."""

    def release_conn(self) -> None:
        return None


def test_a_list_page_holding_more_than_was_asked_is_refused_whole() -> None:
    """A page of 3,000,000 items (none a slice) was once decoded item by item, holding the interpreter
    for seconds (the event loop's health checks timed out) and then read as "no slices": the pool
    drained its engines. A page of more items than the `limit` asked is not the API's answer."""
    from backends.discovery.kubernetes import LIST_PAGE, SliceWatch, Unusable

    page = b'{"metadata": {"resourceVersion": "5"}, "items": [' + b"1," * LIST_PAGE + b"1]}"

    class Api:
        def list_namespaced_endpoint_slice(self, *args: object, **kwargs: object) -> _Page:
            return _Page(page)

    delivered: list[object] = []
    config = KubernetesDiscoveryConfig.model_validate({"service": "engines", "namespace": "default"})
    with pytest.raises(Unusable, match="at most"):
        SliceWatch(config, delivered.append)._list(Api())  # type: ignore[arg-type]
    assert delivered == []
