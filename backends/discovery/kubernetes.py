"""List and watch EndpointSlices with the official `kubernetes` client, in a thread of its own.

The client is synchronous (urllib3), so one daemon thread per pool runs the API machinery's
list+watch loop and hands every change to the event loop through `deliver` (thread-safe, given by
the caller):

    list (paged)  -> Reset(all slices), remember the list's resourceVersion
    watch from it -> Upsert(slice) for ADDED / MODIFIED, Delete(name) for DELETED; BOOKMARK events
                     only move the resourceVersion on; each watch ends after `watch_timeout_s`
                     and the next one starts from the last resourceVersion seen
    410 Gone      -> that resourceVersion is too old: list again (a fresh Reset)
    `rack_label`  -> before a Reset or Upsert naming nodes not seen yet, each such node is read once
                     (GET /api/v1/nodes/NAME) and NodeRacks(node -> that label's value) delivered
    other errors  -> Failure(why), wait (exponential backoff), watch again from the last version

Objects are read raw (`_preload_content=False`) and decoded once, here, by `slices.decode_slice`:
what crosses to the event loop is only validated `Slice` values, never the API server's JSON.
What the API server answers is input, read within bounds:

    a list page       -> at most MAX_PAGE_BYTES (64 MiB), a JSON object with `items` a list (of at
                         most the LIST_PAGE asked for) and a
                         resourceVersion; at most MAX_LIST_PAGES (200) pages; else the whole list
                         fails (nothing delivered: the pool keeps its last good set)
    a watch line      -> at most MAX_EVENT_BYTES (4 MiB), a JSON object of a known event type;
                         else the watch ends as failed and is retried with backoff from the last
                         version; a line cut by the end of the stream is dropped
    a slice           -> not one (fields of the wrong type, past the API's own bounds): ignored
                         with a warning, the pool keeps that slice's last good version
    ERROR events      -> their `code` when it is an HTTP status, else 500
    410 right after a list -> a failure with backoff, then a list (no list-410 loop at full speed)
    a node            -> at most 1 MiB; a rack label that is not a label value reads as unknown

Stopping closes the open watch response, so the thread ends within a moment even when the server
is silent.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from backends.discovery.slices import (
    Delete,
    Failure,
    InvalidSlice,
    KubernetesDiscoveryConfig,
    NodeRacks,
    Reset,
    Slice,
    Upsert,
    WatchEvent,
    decode_slice,
    label_value,
    resource_version,
    slice_name,
)

log = logging.getLogger(__name__)

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
LIST_PAGE = 500
MAX_LIST_PAGES = 200  # 100,000 slices: a list that still names a next page after these is refused
MAX_PAGE_BYTES = 64 * 1024 * 1024  # one page of a list (500 slices of at most 1,000 endpoints each)
MAX_EVENT_BYTES = 4 * 1024 * 1024  # one watch line: one slice (etcd refuses objects past 1.5 MiB)
MAX_NODE_BYTES = 1024 * 1024  # one Node object read for its rack label
READ_CHUNK = 64 * 1024
WATCH_EVENTS = ("ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR")
CONNECT_TIMEOUT_S = 5.0
HTTP_GONE = 410
HTTP_NOT_FOUND = 404


def default_namespace(config: KubernetesDiscoveryConfig) -> str:
    if config.namespace:
        return config.namespace
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or "default"
    except OSError:
        return "default"


def api_client(config: KubernetesDiscoveryConfig) -> k8s_client.ApiClient:
    """An API client: an explicit `api_server` (+ token file), a kubeconfig, else in-cluster."""
    configuration = k8s_client.Configuration()
    if config.api_server:
        configuration.host = config.api_server.rstrip("/")
        if config.token_file:
            token = Path(config.token_file).read_text().strip()
            configuration.api_key = {"authorization": f"Bearer {token}"}
    elif config.kubeconfig:
        k8s_config.load_kube_config(config_file=config.kubeconfig, client_configuration=configuration)  # type: ignore[no-untyped-call, unused-ignore]
    else:
        try:
            k8s_config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call, unused-ignore]
        except k8s_config.ConfigException:
            k8s_config.load_kube_config(client_configuration=configuration)  # type: ignore[no-untyped-call, unused-ignore]
    return k8s_client.ApiClient(configuration)


class Unusable(ValueError):
    """An answer of the API server that cannot be read (not JSON, the wrong shape, beyond its bound):
    the list or watch fails as if the connection had, and is retried with backoff; nothing of it is
    applied."""


def read_bounded(response: Any, limit: int, what: str) -> bytes:
    """The whole body of a raw urllib3 response, refused past `limit` bytes (read in chunks: a
    hostile server's gigabyte is never held)."""
    body = bytearray()
    for chunk in response.stream(READ_CHUNK, decode_content=True):
        body += chunk
        if len(body) > limit:
            raise Unusable(f"{what} is larger than {limit} bytes")
    return bytes(body)


def json_object(data: bytes | bytearray, what: str) -> dict[str, Any]:
    try:
        found = json.loads(data)
    except ValueError:  # not JSON, not UTF-8, nested past the parser's depth
        raise Unusable(f"{what} is not JSON") from None
    except RecursionError:
        raise Unusable(f"{what} is nested too deep") from None
    if not isinstance(found, dict):
        raise Unusable(f"{what} is a JSON {type(found).__name__}, not an object")
    return found


def lines_of(response: Any, limit: int = MAX_EVENT_BYTES) -> Iterator[bytes]:
    """The complete lines of a watch stream (a line cut by the end of the stream is dropped, as the
    event it began never arrived); a line past `limit` bytes ends the stream as unusable."""
    buffer = bytearray()
    for chunk in response.stream(READ_CHUNK, decode_content=True):
        buffer += chunk
        start = 0
        while (end := buffer.find(b"\n", start)) != -1:
            yield bytes(buffer[start:end])
            start = end + 1
        del buffer[:start]
        if len(buffer) > limit:
            raise Unusable(f"a watch event longer than {limit} bytes")


class SliceWatch:
    """The list+watch loop of one pool's EndpointSlices, run by `start()` in a daemon thread."""

    def __init__(
        self,
        config: KubernetesDiscoveryConfig,
        deliver: Callable[[WatchEvent], None],
        *,
        name: str = "endpointslices",
        api: k8s_client.ApiClient | None = None,
    ) -> None:
        self.config = config
        self.namespace = default_namespace(config)
        self.selector = config.selector
        self._deliver = deliver
        self._name = name
        self._api = api
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._response: Any = None
        self._lock = threading.Lock()
        self._core: k8s_client.CoreV1Api | None = None  # reads nodes' rack label (`rack_label` set)
        self.racks: dict[str, str | None] = {}  # node -> its rack label, read once per node
        self.lists = 0  # full lists done (the first one and one per 410 Gone)
        self.watches = 0  # watch requests made

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"k8s-watch {self._name}", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        with self._lock:
            response = self._response
        if response is not None:
            try:
                response.shutdown()  # unblocks a read waiting on a silent watch
            except Exception:  # already closed, or an older urllib3 without shutdown()
                log.debug("closing the watch response failed", exc_info=True)
        if self._thread is not None:
            self._thread.join(timeout_s)

    # -- the loop ------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            api = self._api or api_client(self.config)
        except Exception as exc:
            log.error("kubernetes discovery %s: no API client: %s", self._name, exc)
            self._deliver(Failure(f"no API client: {exc}"))
            return
        discovery = k8s_client.DiscoveryV1Api(api)
        self._core = k8s_client.CoreV1Api(api) if self.config.rack_label else None
        version: str | None = None
        backoff_s = self.config.retry_backoff_s
        while not self._stop.is_set():
            fresh = False  # this watch starts from a version the list just gave
            try:
                if version is None:
                    version, fresh = self._list(discovery), True
                version = self._watch(discovery, version)
                backoff_s = self.config.retry_backoff_s
            except ApiException as exc:
                if exc.status == HTTP_GONE and not fresh:
                    log.info("kubernetes discovery %s: resourceVersion %s expired; listing again", self._name, version)
                    version = None
                    continue
                if exc.status == HTTP_GONE:  # the version it just listed is gone: no list-410 loop at full speed
                    version = None
                backoff_s = self._failed(f"API server answered {exc.status}: {str(exc.reason)[:200]}", backoff_s)
            except Exception as exc:  # connection refused or reset, timeouts, bad JSON
                if self._stop.is_set():
                    break
                backoff_s = self._failed(f"{type(exc).__name__}: {str(exc)[:200]}", backoff_s)

    def _failed(self, reason: str, backoff_s: float) -> float:
        log.warning("kubernetes discovery %s: %s; retrying in %.1fs", self._name, reason, backoff_s)
        self._deliver(Failure(reason))
        self._stop.wait(backoff_s)
        return min(backoff_s * 2, self.config.retry_backoff_max_s)

    def _list(self, discovery: k8s_client.DiscoveryV1Api) -> str:
        """List every page; deliver the decoded slices as one Reset. A page that cannot be read, a
        list without a resourceVersion, or one still paging after MAX_LIST_PAGES fails the whole
        list (nothing delivered: the pool keeps what it has); a slice that is not one is left out."""
        slices: list[Slice] = []
        refused, first_refusal = 0, ""
        cont: str | None = None
        version = ""
        for _ in range(MAX_LIST_PAGES):
            response: Any = discovery.list_namespaced_endpoint_slice(  # the raw urllib3 response
                self.namespace,
                label_selector=self.selector,
                limit=LIST_PAGE,
                _continue=cont,
                _preload_content=False,
                _request_timeout=(CONNECT_TIMEOUT_S, 60.0),
            )
            try:
                body = json_object(read_bounded(response, MAX_PAGE_BYTES, "a list page"), "a list page")
            finally:
                response.release_conn()
            items, metadata = body.get("items"), body.get("metadata")
            items = [] if items is None else items
            if not isinstance(items, list) or not isinstance(metadata, dict) or len(items) > LIST_PAGE:
                raise Unusable(f"a list page without `items` as a list of at most {LIST_PAGE} and `metadata`")
            version = resource_version(body) or ""
            cont = metadata.get("continue") or None
            if cont is not None and not isinstance(cont, str):
                raise Unusable("a list page whose `continue` is not a string")
            for item in items:
                try:
                    slices.append(decode_slice(item, self.config))
                except InvalidSlice as exc:
                    refused += 1
                    first_refusal = first_refusal or str(exc)[:200]
            if not cont:
                break
        else:
            raise Unusable(f"a list still paging after {MAX_LIST_PAGES} pages")
        if not version:
            raise Unusable("a list without a valid resourceVersion")
        if refused:
            log.warning("kubernetes discovery %s: %d listed objects are not EndpointSlices, left out (%s)",
                        self._name, refused, first_refusal)  # fmt: skip
        self.lists += 1
        self._learn_racks(slices)
        self._deliver(Reset(tuple(slices), version))
        return version

    def _watch(self, discovery: k8s_client.DiscoveryV1Api, version: str) -> str:
        """One watch request from `version`; returns the last version seen when it ends."""
        self.watches += 1
        response: Any = discovery.list_namespaced_endpoint_slice(  # the raw urllib3 response
            self.namespace,
            label_selector=self.selector,
            watch=True,
            allow_watch_bookmarks=True,
            resource_version=version,
            timeout_seconds=self.config.watch_timeout_s,
            _preload_content=False,
            _request_timeout=(CONNECT_TIMEOUT_S, self.config.watch_timeout_s + 30.0),
        )
        with self._lock:
            self._response = response
        try:
            for event in self._events(response):
                kind = event.get("type")
                obj = event.get("object")
                if kind not in WATCH_EVENTS or not isinstance(obj, dict):
                    raise Unusable(f"a watch event of type {str(kind)[:40]!r} or without an object")
                if kind == "ERROR":
                    code = obj.get("code")
                    status = code if type(code) is int and 100 <= code < 600 else 500
                    raise ApiException(status=status, reason=str(obj.get("message"))[:200])
                if kind in ("ADDED", "MODIFIED"):
                    try:
                        found = decode_slice(obj, self.config)
                    except InvalidSlice as exc:  # the pool keeps this slice's last good version
                        log.warning("kubernetes discovery %s: %s; ignored", self._name, str(exc)[:200])
                        found = None
                    if found is not None:
                        self._learn_racks([found])
                        self._deliver(Upsert(found))
                elif kind == "DELETED" and slice_name(obj):
                    self._deliver(Delete(slice_name(obj)))
                # BOOKMARK: nothing changed, the version moved on
                version = resource_version(obj) or version
        finally:
            with self._lock:
                self._response = None
            response.close()
            response.release_conn()
        return version

    def _learn_racks(self, slices: list[Slice]) -> None:
        """Read the rack label of nodes not seen yet and deliver it before the slices that name them
        (a node's rack is where it stands: read once, kept for the watch's life, at most
        `max_endpoints` x 4 nodes). A node that cannot be read stays unknown and is asked again later."""
        if self._core is None:
            return
        label = self.config.rack_label
        learnt: list[tuple[str, str | None]] = []
        for node in sorted(set().union(*(s.nodes for s in slices))) if slices else []:
            if node in self.racks or len(self.racks) >= 4 * self.config.max_endpoints:
                continue
            try:
                response: Any = self._core.read_node(
                    node, _preload_content=False, _request_timeout=(CONNECT_TIMEOUT_S, 30.0)
                )
                try:
                    metadata = json_object(read_bounded(response, MAX_NODE_BYTES, "a node"), "a node").get("metadata")
                finally:
                    response.release_conn()
                labels = metadata.get("labels") if isinstance(metadata, dict) else None
            except ApiException as exc:
                if exc.status != HTTP_NOT_FOUND:
                    log.warning(
                        "kubernetes discovery %s: node %s unreadable (%s): rack unknown", self._name, node, exc.status
                    )
                    continue
                labels = {}
            except Exception as exc:  # connection refused or reset, timeouts, bad JSON
                log.warning("kubernetes discovery %s: node %s unreadable (%s): rack unknown", self._name, node, exc)
                continue
            self.racks[node] = label_value(labels.get(label)) if isinstance(labels, dict) else None
            learnt.append((node, self.racks[node]))
        if learnt:
            self._deliver(NodeRacks(tuple(learnt)))

    def _events(self, response: Any) -> Iterator[dict[str, Any]]:
        """The watch's events, each line read as one JSON object; a line that is not one ends the
        watch as unusable (retried with backoff from the last version seen)."""
        for line in lines_of(response):
            if self._stop.is_set():
                return
            if line.strip():
                yield json_object(line, "a watch event")
