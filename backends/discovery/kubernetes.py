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

Objects stay plain JSON dicts (`_preload_content=False`): the decisions in `slices.py` read four
fields and need none of the client's model classes. Stopping closes the open watch response, so
the thread ends within a moment even when the server is silent.
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
from kubernetes.watch.watch import iter_resp_lines

from backends.discovery.slices import (
    Delete,
    Failure,
    KubernetesDiscoveryConfig,
    NodeRacks,
    Reset,
    Upsert,
    WatchEvent,
    node_names,
    resource_version,
    slice_name,
)

log = logging.getLogger(__name__)

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
LIST_PAGE = 500
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
            try:
                if version is None:
                    version = self._list(discovery)
                version = self._watch(discovery, version)
                backoff_s = self.config.retry_backoff_s
            except ApiException as exc:
                if exc.status == HTTP_GONE:
                    log.info("kubernetes discovery %s: resourceVersion %s expired; listing again", self._name, version)
                    version = None
                    continue
                backoff_s = self._failed(f"API server answered {exc.status}: {exc.reason}", backoff_s)
            except Exception as exc:  # connection refused or reset, timeouts, bad JSON
                if self._stop.is_set():
                    break
                backoff_s = self._failed(f"{type(exc).__name__}: {exc}", backoff_s)

    def _failed(self, reason: str, backoff_s: float) -> float:
        log.warning("kubernetes discovery %s: %s; retrying in %.1fs", self._name, reason, backoff_s)
        self._deliver(Failure(reason))
        self._stop.wait(backoff_s)
        return min(backoff_s * 2, self.config.retry_backoff_max_s)

    def _list(self, discovery: k8s_client.DiscoveryV1Api) -> str:
        items: list[dict[str, Any]] = []
        cont: str | None = None
        version = ""
        while True:
            response: Any = discovery.list_namespaced_endpoint_slice(  # the raw urllib3 response
                self.namespace,
                label_selector=self.selector,
                limit=LIST_PAGE,
                _continue=cont,
                _preload_content=False,
                _request_timeout=(CONNECT_TIMEOUT_S, 60.0),
            )
            body = json.loads(response.data)
            items.extend(i for i in body.get("items") or [] if isinstance(i, dict))
            metadata = body.get("metadata") or {}
            version = str(metadata.get("resourceVersion") or version)
            cont = metadata.get("continue") or None
            if not cont:
                break
        self.lists += 1
        self._learn_racks(items)
        self._deliver(Reset(tuple(items), version))
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
                if not isinstance(obj, dict):
                    continue
                if kind == "ERROR":
                    code = obj.get("code")
                    raise ApiException(status=code if isinstance(code, int) else 500, reason=str(obj.get("message")))
                version = resource_version(obj) or version
                if kind in ("ADDED", "MODIFIED"):
                    self._learn_racks([obj])
                    self._deliver(Upsert(obj))
                elif kind == "DELETED":
                    self._deliver(Delete(slice_name(obj)))
                # BOOKMARK: nothing changed, the version moved on
        finally:
            with self._lock:
                self._response = None
            response.close()
            response.release_conn()
        return version

    def _learn_racks(self, slices: list[dict[str, Any]]) -> None:
        """Read the rack label of nodes not seen yet and deliver it before the slices that name them
        (a node's rack is where it stands: read once, kept for the watch's life, at most
        `max_endpoints` x 4 nodes). A node that cannot be read stays unknown and is asked again later."""
        if self._core is None:
            return
        label = self.config.rack_label
        learnt: list[tuple[str, str | None]] = []
        for node in sorted(set().union(*(node_names(s) for s in slices))) if slices else []:
            if node in self.racks or len(self.racks) >= 4 * self.config.max_endpoints:
                continue
            try:
                response: Any = self._core.read_node(
                    node, _preload_content=False, _request_timeout=(CONNECT_TIMEOUT_S, 30.0)
                )
                labels = (json.loads(response.data).get("metadata") or {}).get("labels") or {}
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
            rack = labels.get(label) if isinstance(labels, dict) else None
            self.racks[node] = str(rack) if isinstance(rack, str) and rack else None
            learnt.append((node, self.racks[node]))
        if learnt:
            self._deliver(NodeRacks(tuple(learnt)))

    def _events(self, response: Any) -> Iterator[dict[str, Any]]:
        for line in iter_resp_lines(response):  # type: ignore[no-untyped-call, unused-ignore]
            if self._stop.is_set():
                return
            if not line.strip():
                continue
            event = json.loads(line)
            if isinstance(event, dict):
                yield event
