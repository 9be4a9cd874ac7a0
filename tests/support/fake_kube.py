"""A fake Kubernetes API server for EndpointSlices: enough of the list+watch protocol to test a real
client against, with no cluster.

What it speaks, as the API server does:
- `GET /apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices` lists (`labelSelector` with
  `k=v` terms, `limit` + `continue` paging, `metadata.resourceVersion` of the collection);
- with `watch=1` it streams one JSON event per line over chunked transfer encoding (ADDED,
  MODIFIED, DELETED), starting after `resourceVersion`, every object carrying its own
  `metadata.resourceVersion`; BOOKMARK events (only the version) when `allowWatchBookmarks` is
  set; the stream ends after `timeoutSeconds`;
- a watch from a version older than the retained history is answered `410 Gone` (as an HTTP
  status or, like a watch cache that expires mid-stream, as an ERROR event with a Status of code
  410), and `compact()` ends every open watch that way;
- `GET /api/v1/nodes/{name}`: a node with the labels in `nodes`, else 404 (read for `rack_label`).

The server runs on its own event loop in a thread, so tests may block (sync clients) without
stalling it. Control methods are thread-safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from tests.support.procs import free_port

PATH = "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
NODE_PATH = "/api/v1/nodes/{name}"


def endpoint_slice(
    name: str,
    service: str,
    addresses: list[tuple[str, str | None]],
    *,
    port: int,
    port_name: str = "http",
    ready: bool = True,
    terminating: bool = False,
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    """An EndpointSlice object: one endpoint per (IP, pod name) on one port."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "labels": {"kubernetes.io/service-name": service, **(labels or {})},
        },
        "addressType": "IPv4",
        "ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
        "endpoints": [
            {
                "addresses": [ip],
                "conditions": {"ready": ready, "serving": ready or terminating, "terminating": terminating},
                **({"targetRef": {"kind": "Pod", "name": pod, "namespace": "default"}} if pod else {}),
            }
            for ip, pod in addresses
        ],
    }


@dataclass
class _Watcher:
    namespace: str
    selector: dict[str, str]
    queue: asyncio.Queue[dict[str, Any] | None] = field(default_factory=asyncio.Queue)


class FakeKubeApi:
    def __init__(self, *, bookmark_interval_s: float = 0.2, gone_as_status: bool = False) -> None:
        self.port = free_port()
        self.bookmark_interval_s = bookmark_interval_s
        self.gone_as_status = gone_as_status  # 410 as the HTTP status of the watch request, else an event
        self.version = 100
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.history: list[tuple[int, str, dict[str, Any]]] = []
        self.oldest_version = self.version  # watches from before this get 410 Gone
        self.lists = 0
        self.watches = 0
        self.watch_versions: list[str] = []  # resourceVersion of each watch request, in order
        self.authorizations: set[str] = set()
        self.bookmarks_sent: list[int] = []  # the version each BOOKMARK event carried
        self.nodes: dict[str, dict[str, str]] = {}  # node name -> its labels (GET /api/v1/nodes/NAME)
        self.node_reads: list[str] = []  # the nodes read, in order
        self._watchers: list[_Watcher] = []
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="fake-kube-api", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> FakeKubeApi:
        self._thread.start()
        self._call(self._start())
        return self

    def stop(self) -> None:
        self._call(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def __enter__(self) -> FakeKubeApi:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get(PATH, self._handle)
        app.router.add_get(NODE_PATH, self._node)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def _stop(self) -> None:
        for watcher in self._watchers:
            watcher.queue.put_nowait(None)
        if self._runner is not None:
            await self._runner.cleanup()

    # -- control (thread-safe) ------------------------------------------------------------------

    def upsert(self, obj: dict[str, Any], namespace: str = "default") -> int:
        return int(self._call(self._change(namespace, obj, delete=False)))

    def delete(self, name: str, namespace: str = "default") -> int:
        obj = self.objects.get((namespace, name))
        assert obj is not None, f"no slice {name}"
        return int(self._call(self._change(namespace, obj, delete=True)))

    def compact(self) -> None:
        """Forget the history (as etcd compaction does): open watches end with 410, and watching
        from any version seen so far is refused with 410."""
        self._call(self._compact())

    def drop_watches(self) -> None:
        """Close every open watch stream without an event (a connection lost)."""
        self._call(self._drop())

    # -- internals ------------------------------------------------------------------------------

    async def _change(self, namespace: str, obj: dict[str, Any], *, delete: bool) -> int:
        self.version += 1
        obj = orjson.loads(orjson.dumps(obj))
        obj["metadata"]["resourceVersion"] = str(self.version)
        obj["metadata"]["namespace"] = namespace
        key = (namespace, obj["metadata"]["name"])
        kind = "DELETED" if delete else ("MODIFIED" if key in self.objects else "ADDED")
        if delete:
            self.objects.pop(key, None)
        else:
            self.objects[key] = obj
        self.history.append((self.version, kind, obj))
        for watcher in self._watchers:
            if watcher.namespace == namespace and _matches(obj, watcher.selector):
                watcher.queue.put_nowait({"type": kind, "object": obj})
        return self.version

    async def _compact(self) -> None:
        self.history.clear()
        self.version += 1
        self.oldest_version = self.version
        for watcher in self._watchers:
            if not self.gone_as_status:  # else the stream just ends and the next watch gets HTTP 410
                watcher.queue.put_nowait(_gone())
            watcher.queue.put_nowait(None)

    async def _drop(self) -> None:
        for watcher in self._watchers:
            watcher.queue.put_nowait(None)

    async def _node(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        self.node_reads.append(name)
        labels = self.nodes.get(name)
        if labels is None:
            status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404}
            return web.Response(status=404, body=orjson.dumps(status), content_type="application/json")
        body = {"kind": "Node", "apiVersion": "v1", "metadata": {"name": name, "labels": labels}}
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        auth = request.headers.get("Authorization")
        if auth:
            self.authorizations.add(auth)
        namespace = request.match_info["namespace"]
        selector = _parse_selector(request.query.get("labelSelector", ""))
        if request.query.get("watch") in ("1", "true", "True"):
            return await self._watch(request, namespace, selector)
        self.lists += 1
        items = sorted(
            (o for (ns, _), o in self.objects.items() if ns == namespace and _matches(o, selector)),
            key=lambda o: o["metadata"]["name"],
        )
        start = int(request.query.get("continue") or 0)
        limit = int(request.query.get("limit") or 0) or len(items) or 1
        page = items[start : start + limit]
        metadata: dict[str, Any] = {"resourceVersion": str(self.version)}
        if start + limit < len(items):
            metadata["continue"] = str(start + limit)
        body = {"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1", "metadata": metadata, "items": page}
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    async def _watch(self, request: web.Request, namespace: str, selector: dict[str, str]) -> web.StreamResponse:
        self.watches += 1
        since = request.query.get("resourceVersion") or ""
        self.watch_versions.append(since)
        bookmarks = request.query.get("allowWatchBookmarks") in ("1", "true", "True")
        timeout_s = float(request.query.get("timeoutSeconds") or 1800)
        if since and int(since) < self.oldest_version and self.gone_as_status:
            return web.Response(status=410, body=orjson.dumps(_gone()["object"]), content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        watcher = _Watcher(namespace, selector)
        if since and int(since) < self.oldest_version:
            watcher.queue.put_nowait(_gone())
            watcher.queue.put_nowait(None)
        else:
            for version, kind, obj in self.history:
                if version > int(since or 0) and obj["metadata"]["namespace"] == namespace and _matches(obj, selector):
                    watcher.queue.put_nowait({"type": kind, "object": obj})
        self._watchers.append(watcher)
        deadline = self._loop.time() + timeout_s
        try:
            while True:
                left = deadline - self._loop.time()
                if left <= 0:
                    break
                wait_s = min(left, self.bookmark_interval_s) if bookmarks else left
                try:
                    event = await asyncio.wait_for(watcher.queue.get(), wait_s)
                except TimeoutError:
                    if bookmarks:
                        self.bookmarks_sent.append(self.version)
                        event = {
                            "type": "BOOKMARK",
                            "object": {
                                "kind": "EndpointSlice",
                                "apiVersion": "discovery.k8s.io/v1",
                                "metadata": {"resourceVersion": str(self.version)},
                            },
                        }
                    else:
                        continue
                if event is None:
                    break
                await response.write(orjson.dumps(event) + b"\n")
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self._watchers.remove(watcher)
        with contextlib.suppress(ConnectionResetError):
            await response.write_eof()
        return response

    def open_watches(self) -> int:
        return len(self._watchers)

    def items(self) -> Iterator[dict[str, Any]]:
        return iter(list(self.objects.values()))


def _gone() -> dict[str, Any]:
    return {
        "type": "ERROR",
        "object": {
            "kind": "Status",
            "apiVersion": "v1",
            "status": "Failure",
            "message": "too old resource version",
            "reason": "Expired",
            "code": 410,
        },
    }


def _parse_selector(text: str) -> dict[str, str]:
    terms = {}
    for term in filter(None, (t.strip() for t in text.split(","))):
        key, sep, value = term.partition("=")
        assert sep, f"the fake API server only knows equality selectors, got {term!r}"
        terms[key.strip()] = value.strip().lstrip("=")
    return terms


def _matches(obj: dict[str, Any], selector: dict[str, str]) -> bool:
    labels = obj["metadata"].get("labels") or {}
    return all(labels.get(k) == v for k, v in selector.items())
