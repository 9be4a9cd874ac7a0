"""Probe: what the identity provider and the cluster API answer is input too (hypothesis-drawn answers).

`upstream_fuzz` asks what happens when an engine answers wrongly. Two other outside services feed the
gateway answers: the console's OpenID Connect provider (its discovery document, its JWKS, its token
endpoint's answer and the ID token inside it) and the Kubernetes API server that discovery lists and
watches EndpointSlices from. Here both are stand-ins in this process answering what each example draws,
in front of one `tokenway serve` configured with single sign-on against the one and a discovered pool
against the other:

- the stand-in provider answers the discovery document, the JWKS and the token request with a valid
  answer or a broken one (any status, not JSON, JSON of the wrong shape, beyond 512 KiB, slower than
  `timeout_s`; keys of unknown `kty`, an RSA key of a million bits, encryption keys beside the signing
  one; an ID token with `alg: none`, an HMAC keyed by the public key, another key, a header that is not
  JSON, claims `iss` / `aud` / `exp` / `iat` / `nonce` / `sub` wrong or of the wrong type, a groups claim
  as a string, a map or 30,000 entries), and a client plays the browser: `GET /ui/oidc/login`, then the
  callback with the right or a drawn `state`, `code` and flow cookie (bytes that are not UTF-8 too).
  The first tenth of the examples runs against a gateway that has not read a discovery document yet
  (a document is kept an hour once read), each drawing its document;
- the stand-in API server answers each list and watch with a drawn script: slices with every field of
  the wrong type, ports out of range, addresses that are not addresses, 2,000 or 100,000 endpoints,
  nodes whose labels are of any shape (`rack_label` is read), watch streams with lines that are not
  JSON, cut mid-line, ERROR events with any code, resourceVersions of any shape, 410 Gone, lists that
  page forever or are not JSON. One valid slice (a live engine) is in every well-formed list;
- meanwhile each example sends a chat request to the discovered pool and to a static one.

Targets:
- no 5xx to the browser but the documented 502 `oidc_provider_failed`, and every answer in the
  console's error shape or a redirect; none to the API clients (both pools keep answering 200);
- no console session from an answer that is invalid, and one from every answer that is;
- no request meeting a bug in the log (`UNEXPECTED_IN_LOG`) and no traceback at all;
- afterwards the discovered pool holds only endpoints whose URL is an IP address and a port in range,
  at most `max_endpoints` of them; the watch still runs: a valid slice sent after all of it is
  applied (its endpoint is health-checked and serves a chat request);
- the gateway's resident memory grows by less than `MAX_RSS_GROWTH` over the run.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import http.client
import ipaddress
import json
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit

import orjson
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from bench.chaos import schema_fuzz
from bench.chaos.common import ADMIN, KEY, MODEL, examples_block, fuzz_settings, policies, unexpected_errors, until
from bench.chaos.fuzz import json_values
from bench.chaos.upstream_fuzz import Answer, HostileEngine
from tests.support.oidc_provider import discovery_document
from tests.support.procs import Gateway, free_port, http_get, running, start_gateway, static_pool

CLIENT_ID, CLIENT_SECRET = "tokenway-console", "control-fuzz-secret"
GROUP = "fuzz-admins"
DISCOVERED_MODEL = "discovered-model"
SERVICE = "engines"
GOOD_SLICE = "engines-good"
FINAL_SLICE = "engines-final"
MAX_ENDPOINTS = 32
RACK_LABEL = "example.com/rack"
IDP_TIMEOUT_S = 0.5
MAX_RSS_GROWTH = 256 * 1024 * 1024
SLOW_S = 1.0  # beyond IDP_TIMEOUT_S: the gateway gives up first
CONSOLE_STATUSES = {302, 303, 400, 403, 404, 429, 502}

# --------------------------------------------------------------------------------------------- HTTP


def http_call(
    port: int, method: str, target: str, headers: dict[str, str] | None = None, body: bytes = b""
) -> tuple[int, list[tuple[str, str]], bytes]:
    """One request over a new connection: (status, every header in order, body); status 0 when
    nothing answered. `target` may hold percent-escapes of any bytes (sent as written)."""
    try:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            connection.putrequest(method, target, skip_accept_encoding=True)
            for name, value in (headers or {}).items():
                connection.putheader(name, value.encode("utf-8", "surrogateescape"))
            if body or method == "POST":
                connection.putheader("Content-Length", str(len(body)))
            connection.endheaders(body or None)
            response = connection.getresponse()
            return response.status, response.getheaders(), response.read()
        finally:
            connection.close()
    except (OSError, http.client.HTTPException):
        return 0, [], b""


def cookies_set(headers: list[tuple[str, str]]) -> dict[str, str]:
    """The cookies an answer sets to a value (a deletion, an empty value with Max-Age=0, is left out)."""
    found: dict[str, str] = {}
    for name, value in headers:
        if name.lower() == "set-cookie":
            jar: SimpleCookie = SimpleCookie()
            with contextlib.suppress(Exception):
                jar.load(value)
            for key, morsel in jar.items():
                if morsel.value and morsel["max-age"] != "0":
                    found[key] = morsel.value
    return found


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


# ------------------------------------------------------------------------------ the stand-in provider


@dataclass
class Reply:
    """One answer of the stand-in provider or API server: a status, a body, maybe after a while."""

    status: int = 200
    body: bytes = b""
    delay_s: float = 0.0


class StandIn(ABC):
    """An aiohttp server on a free loopback port, on its own event loop in a thread (a test blocks
    on its own sockets without stalling it); `routes` are added by the subclass."""

    def __init__(self, name: str) -> None:
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @abstractmethod
    def routes(self, app: web.Application) -> None:
        """Add the stand-in's routes to `app` (the provider's or the API server's)."""

    def __enter__(self) -> StandIn:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._runner is not None:
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        self.routes(app)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()


async def _reply(answer: Reply) -> web.Response:
    if answer.delay_s:
        await asyncio.sleep(answer.delay_s)
    return web.Response(status=answer.status, body=answer.body, content_type="application/json")


class StandInProvider(StandIn):
    """An OpenID Connect provider whose answers a probe sets: `discovery`, `jwks` (None: the valid
    one) and `token` (the token endpoint's next answer)."""

    def __init__(self) -> None:
        super().__init__("stand-in-idp")
        from joserfc.jwk import ECKey

        self.key = ECKey.generate_key("P-256", parameters={"kid": "fuzz-1"})
        self.other_key = ECKey.generate_key("P-256", parameters={"kid": "fuzz-1"})
        self.discovery: Reply | None = None
        self.jwks: Reply | None = None
        self.token = Reply(400, b'{"error":"invalid_grant"}')
        self.served: dict[str, int] = {}

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/.well-known/openid-configuration", self._discovery)
        app.router.add_get("/jwks", self._jwks)
        app.router.add_post("/token", self._token)

    def valid_discovery(self) -> dict[str, Any]:
        return discovery_document(self.url, "ES256")

    def valid_jwks(self) -> dict[str, Any]:
        return {"keys": [self.key.as_dict(private=False)]}

    def _count(self, what: str) -> None:
        self.served[what] = self.served.get(what, 0) + 1

    async def _discovery(self, _: web.Request) -> web.Response:
        self._count("discovery")
        return await _reply(self.discovery or Reply(200, orjson.dumps(self.valid_discovery())))

    async def _jwks(self, _: web.Request) -> web.Response:
        self._count("jwks")
        return await _reply(self.jwks or Reply(200, orjson.dumps(self.valid_jwks())))

    async def _token(self, request: web.Request) -> web.Response:
        await request.read()
        self._count("token")
        return await _reply(self.token)


# ------------------------------------------------------------------------------ the stand-in API server

LIST_PATH = "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
NODE_PATH = "/api/v1/nodes/{name}"


@dataclass
class Script:
    """What the stand-in API server answers next: `next_list` the next list request (None: the valid
    list), `watch` the lines of the next watch (`status` other than 200: that status and `body`),
    ended cleanly or `cut` mid-way; `gone_loop` answers that many more watches 410 at once."""

    next_list: Reply | None = None
    status: int = 200
    lines: list[bytes] = field(default_factory=list)
    cut: bool = False
    gone_loop: int = 0
    endless_pages: bool = False


class StandInApiServer(StandIn):
    """Enough of the Kubernetes API for discovery (list, watch, read a node), answering scripts."""

    def __init__(self) -> None:
        super().__init__("stand-in-kube")
        self.good: list[dict[str, Any]] = []  # the slices every well-formed list holds
        self.scripts: asyncio.Queue[Script] | None = None
        self.nodes: dict[str, bytes] = {}  # node -> the body its read answers
        self.served_scripts = 0
        self.sent_scripts = 0
        self.lists = 0
        self.watches = 0
        self.version = 1000
        self._gone_left = 0
        self._list_next: Reply | None = None
        self._endless = 0  # lists still to answer with pages that never end

    def routes(self, app: web.Application) -> None:
        self.scripts = asyncio.Queue()
        app.router.add_get(LIST_PATH, self._handle)
        app.router.add_get(NODE_PATH, self._node)

    def send(self, script: Script) -> int:
        """Queue `script`; the number of scripts served once it is."""
        assert self.scripts is not None
        self.sent_scripts += 1
        self._loop.call_soon_threadsafe(self.scripts.put_nowait, script)
        return self.sent_scripts

    def valid_list(self) -> dict[str, Any]:
        self.version += 1
        metadata = {"resourceVersion": str(self.version)}
        return {"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1", "metadata": metadata,
                "items": list(self.good)}  # fmt: skip

    async def _node(self, request: web.Request) -> web.Response:
        body = self.nodes.get(request.match_info["name"])
        if body is None:
            return web.Response(status=404, body=b'{"kind":"Status","code":404}', content_type="application/json")
        return web.Response(body=body, content_type="application/json")

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if request.query.get("watch") in ("1", "true", "True"):
            return await self._watch(request)
        self.lists += 1
        if self._endless > 0 and "continue" not in request.query:
            self._endless -= 1
        if self._endless > 0 or request.query.get("continue", "").startswith("endless-"):  # pages that never end
            metadata = {"resourceVersion": "1", "continue": "endless-" + uuid.uuid4().hex}
            page = {**self.valid_list(), "metadata": metadata}
            return web.Response(body=orjson.dumps(page), content_type="application/json")
        answer, self._list_next = self._list_next, None
        return await _reply(answer or Reply(200, orjson.dumps(self.valid_list())))

    async def _watch(self, request: web.Request) -> web.StreamResponse:
        self.watches += 1
        if self._gone_left > 0:
            self._gone_left -= 1
            return web.Response(status=410, body=orjson.dumps(_gone()), content_type="application/json")
        assert self.scripts is not None
        try:  # a watch with nothing to say stays open a while, as a real one does
            script = await asyncio.wait_for(self.scripts.get(), 0.5)
        except TimeoutError:
            return web.Response(status=200, body=b"", content_type="application/json")
        self._list_next, self._gone_left = script.next_list, script.gone_loop
        self._endless = 3 if script.endless_pages else 0  # two lists that page forever
        try:
            if script.status != 200:
                return web.Response(status=script.status, body=b"".join(script.lines), content_type="application/json")
            response = web.StreamResponse(headers={"Content-Type": "application/json"})
            response.enable_chunked_encoding()
            with contextlib.suppress(ConnectionError):
                await response.prepare(request)
                for line in script.lines:
                    await response.write(line)
                if script.cut and request.transport is not None:
                    request.transport.abort()
                    return response
                await response.write_eof()
            return response
        finally:
            self.served_scripts += 1


def _gone() -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Expired", "code": 410,
            "message": "too old resource version"}  # fmt: skip


def endpoint_slice(name: str, addresses: list[tuple[str, str]], port: int) -> dict[str, Any]:
    """A valid EndpointSlice of the Service: one ready endpoint per (IP, pod name) on port `http`."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "labels": {"kubernetes.io/service-name": SERVICE}, "resourceVersion": "7"},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": [
            {"addresses": [ip], "conditions": {"ready": True}, "targetRef": {"kind": "Pod", "name": pod},
             "nodeName": "node-good", "zone": "z1"}
            for ip, pod in addresses
        ],
    }  # fmt: skip


def event_line(kind: str, obj: Any) -> bytes:
    return json.dumps({"type": kind, "object": obj}).encode() + b"\n"


# ----------------------------------------------------------------------------------- what is drawn

# Addresses that are addresses (but nothing a chat may reach: the engine listens on 127.0.0.1 only,
# and each of these sorts after it, so the bound never drops it) and ones that are not.
GOOD_ADDRESSES = ("127.0.1.7", "127.0.2.9", "127.4.5.6", "::1", "fd00::7")
BAD_ADDRESSES = ("not-an-ip", "", "999.1.1.1", "10.0.0.1/24", "127.0.1.1:80", "http://127.0.1.1", "[::1]",
                 "127.0.1.1\r\nHost: x", "0.0.0.0", "::", "224.0.0.1", "127.0.1.1 ", "\uff11\uff12\uff17.0.0.1", 7,
                 None, True,
                 ["127.0.1.1"], {"ip": "127.0.1.1"})  # fmt: skip
PORTS = st.sampled_from((1, 8000, 65535, 0, -1, 65536, 10**12, True, "8000", None, 1.5, [80]))
NAMES = st.sampled_from(("s-0", "s-1", "s-2", "s-3", "", "x" * 300, "a/b", "S-UPPER", 7, None, ["s-0"]))
VERSIONS = st.sampled_from(("1", "2000", "", "-1", "abc", "9" * 200, 5, None, [1], {"v": 1}, True, 1.5))
SLICE_FIELDS = ("metadata", "metadata.name", "metadata.resourceVersion", "addressType", "ports", "ports.0",
                "ports.0.port", "ports.0.name", "endpoints", "endpoints.0", "endpoints.0.addresses",
                "endpoints.0.conditions", "endpoints.0.conditions.ready", "endpoints.0.conditions.terminating",
                "endpoints.0.targetRef", "endpoints.0.targetRef.name", "endpoints.0.nodeName",
                "endpoints.0.zone")  # fmt: skip
_HUGE: dict[int, dict[str, Any]] = {}


def _huge_slice(count: int) -> dict[str, Any]:
    """A slice of `count` ready endpoints (built once: drawing 100,000 of them would take the run)."""
    if count not in _HUGE:
        addresses = [(f"127.{9 + i // 65536}.{i // 256 % 256}.{i % 256}", f"pod-{i}") for i in range(count)]
        _HUGE[count] = endpoint_slice(f"huge-{count}", addresses, 8000)
    return _HUGE[count]


def _set_path(obj: Any, path: str, value: Any) -> None:
    *parents, last = path.split(".")
    for part in parents:
        if isinstance(obj, list):
            obj = obj[int(part)] if part.isdigit() and int(part) < len(obj) else None
        else:
            obj = obj.get(part) if isinstance(obj, dict) else None
        if obj is None:
            return
    if isinstance(obj, list) and last.isdigit() and int(last) < len(obj):
        obj[int(last)] = value
    elif isinstance(obj, dict):
        obj[last] = value


@st.composite
def slices(draw: st.DrawFn) -> Any:
    """An EndpointSlice as a hostile API server sends it (never the good one's name)."""
    kind = draw(st.integers(0, 12))
    if kind == 0:
        return draw(json_values)
    if kind == 1:
        return _huge_slice(draw(st.sampled_from((2000, 100_000))))
    count = draw(st.integers(0, 4))
    obj = endpoint_slice(str(draw(NAMES)), [], 8000)
    obj["metadata"]["name"] = draw(NAMES)
    obj["metadata"]["resourceVersion"] = draw(VERSIONS)
    obj["addressType"] = draw(st.sampled_from(("IPv4", "IPv4", "IPv6", "FQDN", 4, None)))
    obj["ports"][0]["port"] = draw(PORTS)
    for _ in range(count):
        address = draw(st.sampled_from(GOOD_ADDRESSES + BAD_ADDRESSES))
        endpoint: dict[str, Any] = {"addresses": [address], "conditions": {"ready": True}}
        if draw(st.booleans()):
            endpoint["targetRef"] = {"kind": "Pod", "name": draw(st.sampled_from(("pod-a", "engine-good", "x" * 300,
                                                                                    "bad/name", 5)))}  # fmt: skip
        if draw(st.booleans()):
            endpoint["nodeName"] = draw(st.sampled_from(("node-a", "node-b", "node-" + "n" * 300, 7, "")))
        if draw(st.booleans()):
            endpoint["conditions"] = draw(st.sampled_from(({}, {"ready": "false"}, {"ready": 0}, {"ready": None},
                                                           {"terminating": "true"}, [], "ready")))  # fmt: skip
        obj["endpoints"].append(endpoint)
    for path in draw(st.lists(st.sampled_from(SLICE_FIELDS), max_size=3)):
        _set_path(obj, path, draw(json_values))
    if obj.get("metadata", {}) == {} or (
        isinstance(obj.get("metadata"), dict) and obj["metadata"].get("name") == GOOD_SLICE
    ):
        obj["metadata"] = {"name": "s-9"}
    return obj


@st.composite
def scripts(draw: st.DrawFn) -> Script:
    """The API server's next answers: a watch stream (or status), and sometimes the next list."""
    lines: list[bytes] = []
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.integers(0, 9))
        if kind <= 3:
            lines.append(event_line(draw(st.sampled_from(("ADDED", "MODIFIED", "ADDED"))), draw(slices())))
        elif kind == 4:
            lines.append(event_line("DELETED", draw(slices())))
        elif kind == 5:
            lines.append(event_line("BOOKMARK", {"metadata": {"resourceVersion": draw(VERSIONS)}}))
        elif kind == 6:
            code = draw(st.sampled_from((410, 500, 403, "410", None, True, 10**20)))
            lines.append(event_line("ERROR", {"kind": "Status", "code": code, "message": draw(json_values)}))
        elif kind == 7:
            lines.append(draw(st.sampled_from((b"{\n", b"[]\n", b"null\n", b"\xff\xfe\n", b"\n", b'{"type": 5}\n',
                                               b'{"type":"ADDED","object":[1]}\n', b"garbage"))))  # fmt: skip
        elif kind == 8:
            lines.append(json.dumps(draw(json_values)).encode() + b"\n")
        else:
            lines.append(draw(st.binary(max_size=40)))
    if draw(st.integers(0, 40)) == 0:
        lines.append(b'{"type":"ADDED","object":{"x":"' + b"y" * 6_000_000 + b'"}}\n')  # one line of 6 MB
    script = Script(lines=lines, cut=draw(st.integers(0, 4)) == 0)
    if script.cut and lines:
        last = lines[-1]
        lines[-1] = last[: draw(st.integers(0, max(0, len(last) - 1)))]
    pick = draw(st.integers(0, 11))
    if pick == 0:
        script.status = draw(st.sampled_from((410, 500, 403, 200)))
    elif pick == 1:
        script.gone_loop = draw(st.integers(1, 5))
    if draw(st.integers(0, 5)) == 0:  # and the next list: broken, or holding hostile slices beside the good
        script.next_list = draw(lists())
        script.lines.append(event_line("ERROR", _gone()))
    elif draw(st.integers(0, 30)) == 0:
        script.endless_pages = True
        script.lines.append(event_line("ERROR", _gone()))
    return script


@st.composite
def lists(draw: st.DrawFn) -> Reply | None:
    kind = draw(st.integers(0, 5))
    if kind == 0:
        return Reply(draw(st.sampled_from((500, 403, 200))), draw(st.binary(max_size=60)))
    if kind == 1:
        return Reply(200, json.dumps(draw(json_values)).encode())
    if kind == 2:
        return Reply(200, b'{"metadata":{"resourceVersion":"5"},"items":[' + b"1," * 3_000_000 + b"1]}")
    # a well-formed list: the good slices and hostile ones, fields of the list itself maybe swapped
    items: list[Any] = [*_GOOD_SLICES, *draw(st.lists(slices(), max_size=4))]
    body: dict[str, Any] = {"kind": "EndpointSliceList", "metadata": {"resourceVersion": "4242"}, "items": items}
    if kind == 3:
        body["metadata"] = draw(st.sampled_from(({"resourceVersion": 5}, {"resourceVersion": None}, [], "m",
                                                 {"resourceVersion": "7", "continue": 5})))  # fmt: skip
    return Reply(200, json.dumps(body).encode())


_GOOD_SLICES: list[dict[str, Any]] = []  # set when the probe starts (the engine's port)


# --- the provider's side


@dataclass
class Login:
    """What the provider answers one login, and whether a session must (True), must not (False) or may
    (None: a case the probe does not decide) come of it."""

    discovery: Reply | None
    jwks: Reply | None
    token: Any  # a function of the nonce -> Reply
    valid: bool | None
    why: str


CLAIM_BREAKERS: dict[str, tuple[Any, ...]] = {
    "iss": ("http://evil.example", "", 5, None, ["x"]),
    "aud": ("another-client", ["another-client"], 5, None, {"aud": CLIENT_ID}, [5]),
    "exp": (1, "9999999999", None, [1], float("inf"), -1),
    "iat": ("now", None, [1], {"t": 1}),
    "nonce": ("another-nonce", 5, None, ["x"]),
    "sub": (5, None, ["sub"], {"s": 1}),
}
GROUPS_HARMLESS: tuple[Any, ...] = (
    GROUP,
    [GROUP],
    [GROUP, 5, None, {"g": 1}],
    [GROUP, *("g" * 20 for _ in range(1000))],
)
GROUPS_NONE: tuple[Any, ...] = ({GROUP: True}, 5, None, [], ["other"], [["fuzz-admins"]], "other", [GROUP.upper()])


def _claims(nonce: str, provider: StandInProvider) -> dict[str, Any]:
    now = int(time.time())
    return {"iss": provider.url, "aud": CLIENT_ID, "sub": "sub-fuzz", "iat": now, "exp": now + 300, "nonce": nonce,
            "email": "fuzz@example.com", "email_verified": True, "groups": [GROUP]}  # fmt: skip


def _sign(claims: Any, provider: StandInProvider, key: Any = None, header: dict[str, Any] | None = None) -> str:
    from joserfc import jws

    payload = json.dumps(claims).encode()
    return jws.serialize_compact(header or {"alg": "ES256", "kid": "fuzz-1"}, payload, key or provider.key)


def _raw_token(header: Any, claims: Any, signature: bytes = b"sig") -> str:
    return ".".join((_b64(json.dumps(header).encode()), _b64(json.dumps(claims).encode()), _b64(signature)))


@st.composite
def logins(draw: st.DrawFn, provider: StandInProvider, discovery_phase: bool) -> Login:
    """A provider's answers for one login, and what must come of them."""
    discovery: Reply | None = None
    breaks: list[str] = []
    ambiguous = discovery_phase  # a hostile document the gateway accepts is kept, and decides later logins
    if discovery_phase:
        doc = provider.valid_discovery()
        field_ = draw(st.sampled_from(("issuer", "authorization_endpoint", "token_endpoint", "jwks_uri",
                                        "token_endpoint_auth_methods_supported", "body")))  # fmt: skip
        hostile = st.sampled_from((None, 5, "", "relative/path", "javascript:alert(1)", "http://127.0.0.1:99999/x",
                                   "http://[::1", "http://x\r\nSet-Cookie: a=b", "https://", "http://127.0.0.1:1/t",
                                   "http://exa mple.com/", ["http://x"], {"u": 1}, "ftp://x/"))  # fmt: skip
        if field_ == "body":
            discovery = draw(st.sampled_from((Reply(200, b"not json"), Reply(200, b"[]"), Reply(500, b"{}"),
                                              Reply(200, b'{"a":"' + b"x" * 600_000 + b'"}'),
                                              Reply(200, orjson.dumps(doc), SLOW_S))))  # fmt: skip
        elif field_ == "token_endpoint_auth_methods_supported":
            doc[field_] = draw(st.sampled_from((5, "client_secret_post", None, {"a": 1}, [5, None], [])))
            discovery = Reply(200, orjson.dumps(doc))
        else:
            doc[field_] = draw(hostile)
            discovery = Reply(200, json.dumps(doc).encode())
    jwks_kind = draw(st.integers(0, 9))
    jwks: Reply | None = None
    if jwks_kind == 0:
        jwks = draw(st.sampled_from((Reply(200, b"not json"), Reply(500, b"{}"), Reply(200, b'{"keys": 5}'),
                                     Reply(200, b'{"keys": "abc"}'), Reply(200, b"[]"), Reply(200, b'{"keys": [[1]]}'),
                                     Reply(200, b'{"keys": []}'), Reply(200, b"{}", SLOW_S))))  # fmt: skip
        ambiguous = True  # keys read before are kept: this set is read only when a token names another
    elif jwks_kind == 1:  # odd keys beside the signing key: the signing key still verifies
        good = provider.key.as_dict(private=False)
        odd = draw(st.lists(st.sampled_from((
            {"kty": "XYZ", "kid": "odd"}, {"kty": "RSA", "kid": "big", "n": _b64(b"\xff" * 131072), "e": "AQAB"},
            {"kty": "oct", "kid": "sym", "k": "c2VjcmV0"}, {"kty": "EC", "crv": "P-999", "x": "a", "y": "b"},
            {**good, "kid": "enc", "use": "enc"}, {"kty": 5}, {"kid": ["x"]}, 7, None, "key",
            {"kty": "OKP", "crv": "Ed25519", "x": "AAAA"}, {"kty": "RSA", "n": 5, "e": None})),
            min_size=1, max_size=4))  # fmt: skip
        keys = [*odd, good] if draw(st.booleans()) else [good, *odd]
        jwks = Reply(200, json.dumps({"keys": keys}).encode())
    elif jwks_kind == 2:  # the signing key is not there
        jwks = Reply(200, json.dumps({"keys": [provider.other_key.as_dict(private=False) | {"kid": "other"}]}).encode())
        ambiguous = True
    token_kind = draw(st.integers(0, 13))
    claims_change: tuple[str, Any] | None = None
    groups: Any = [GROUP]
    if token_kind in (0, 1):
        name = draw(st.sampled_from(sorted(CLAIM_BREAKERS)))
        claims_change = (name, draw(st.sampled_from(CLAIM_BREAKERS[name])))
        breaks.append(f"claim {name} = {claims_change[1]!r}"[:80])
    elif token_kind == 2:
        groups = draw(st.sampled_from(GROUPS_HARMLESS))
    elif token_kind == 3:
        groups = draw(st.sampled_from(GROUPS_NONE))
        breaks.append(f"groups {groups!r}"[:80])
    elif token_kind == 4:
        groups = [*("g" * 10 for _ in range(30_000)), GROUP]  # the group past the first thousand
        breaks.append("the group beyond the first thousand")
    elif token_kind == 5:
        claims_change = (draw(st.sampled_from(("email", "email_verified", "name", "azp"))), draw(json_values))
    token_variant = draw(st.integers(0, 12)) if token_kind == 6 else -1
    status_variant = draw(st.integers(0, 6)) if token_kind == 7 else -1

    def token(nonce: str) -> Reply:
        claims: dict[str, Any] = _claims(nonce, provider)
        claims["groups"] = groups
        if claims_change is not None:
            claims[claims_change[0]] = claims_change[1]
        id_token: Any
        if token_variant < 0:
            id_token = _sign(claims, provider)
        else:
            variants = (
                lambda: _raw_token({"alg": "none"}, claims, b""),
                lambda: _raw_token({"alg": "none", "kid": "fuzz-1"}, claims, b""),
                lambda: _hmac_token(claims, provider),
                lambda: _sign(claims, provider, key=provider.other_key),
                lambda: _sign(claims, provider, header={"alg": "ES256", "kid": "nobody"}),
                lambda: _raw_token({"alg": "ES256", "kid": 5}, claims),
                lambda: _raw_token({"alg": "ES256", "kid": "fuzz-1", "crit": ["exp"]}, claims),
                lambda: "a.b",
                lambda: "a.b.c.d",
                lambda: "...",
                lambda: "x" * 100,
                lambda: _b64(b"[1]") + "." + _b64(b"{}") + ".c",
                lambda: _sign([1, 2], provider),
            )
            id_token = variants[token_variant]()
        answer: dict[str, Any] = {"access_token": "at", "token_type": "Bearer", "id_token": id_token}
        if status_variant >= 0:
            return (
                Reply(200, b"not json"), Reply(200, b"[]"), Reply(200, b'{"id_token": 5}'),
                Reply(400, b'{"error": {"nested": 1}}'), Reply(500, b"<html>"),
                Reply(200, orjson.dumps(answer), SLOW_S),
                Reply(200, b'{"id_token":"' + b"a" * 600_000 + b'"}'),
            )[status_variant]  # fmt: skip
        return Reply(200, json.dumps(answer).encode())

    if token_variant >= 0 or status_variant >= 0:
        breaks.append(f"token variant {token_variant}, answer variant {status_variant}")
    ambiguous = ambiguous or token_kind == 5  # an odd email or azp may or may not be refused: groups grant a role
    valid = False if breaks else None if ambiguous else True
    return Login(discovery, jwks, token, valid, "; ".join(breaks) or ("ambiguous" if ambiguous else "valid"))


def _hmac_token(claims: dict[str, Any], provider: StandInProvider) -> str:
    """HS256 keyed by the provider's public key (the classic algorithm confusion)."""
    import hashlib
    import hmac

    header = _b64(json.dumps({"alg": "HS256", "kid": "fuzz-1"}).encode())
    payload = _b64(json.dumps(claims).encode())
    secret = json.dumps(provider.key.as_dict(private=False)).encode()
    signature = hmac.new(secret, f"{header}.{payload}".encode(), hashlib.sha256).digest()
    return f"{header}.{payload}.{_b64(signature)}"


@st.composite
def callbacks(draw: st.DrawFn) -> tuple[str, str, str]:
    """How the browser comes back: (state, code, cookie) kinds; anything but 'right' breaks it."""
    state = draw(st.sampled_from(("right",) * 14 + ("missing", "other", "bytes", "twice")))
    code = draw(st.sampled_from(("right",) * 14 + ("missing", "empty", "bytes", "huge", "error")))
    cookie = draw(st.sampled_from(("right",) * 14 + ("missing", "other", "bytes")))
    return state, code, cookie


def _callback_target(state: str, code: str, kinds: tuple[str, str, str]) -> str:
    parts: list[str] = []
    state_kind, code_kind, _ = kinds
    if state_kind == "right":
        parts.append("state=" + quote(state))
    elif state_kind == "other":
        parts.append("state=" + uuid.uuid4().hex)
    elif state_kind == "bytes":
        parts.append("state=%FF%FE%00" + quote(state))
    elif state_kind == "twice":
        parts += ["state=" + quote(state), "state=other"]
    if code_kind == "right":
        parts.append("code=" + uuid.uuid4().hex)
    elif code_kind == "empty":
        parts.append("code=")
    elif code_kind == "bytes":
        parts.append("code=%FF%C0%80x")
    elif code_kind == "huge":
        parts.append("code=" + "c" * 6000)
    elif code_kind == "error":
        parts += ["code=x", "error=%FF%FEaccess_denied"]
    return "/ui/oidc/callback?" + "&".join(parts)


# ------------------------------------------------------------------------------------------ the run


def _pool(api: StandInApiServer) -> dict[str, Any]:
    kubernetes = {"namespace": "fuzz", "service": SERVICE, "port": "http", "api_server": api.url,
                  "retry_backoff_s": 0.02, "retry_backoff_max_s": 0.2, "drain_timeout_s": 1,
                  "max_endpoints": MAX_ENDPOINTS, "rack_label": RACK_LABEL, "watch_timeout_s": 30}  # fmt: skip
    return {"name": "discovered", "model": DISCOVERED_MODEL, "engine": "vllm", "discovery": {"kubernetes": kubernetes}}


@contextlib.contextmanager
def started(workdir: Path) -> Iterator[tuple[Gateway, StandInProvider, StandInApiServer, HostileEngine, HostileEngine]]:
    """The stand-ins, two live engines (the good slice's and the final one's, the first also the
    static pool's) and a gateway with single sign-on and a discovered pool."""
    workdir.mkdir(parents=True, exist_ok=True)
    with HostileEngine() as engine, HostileEngine() as final, StandInProvider() as idp, StandInApiServer() as api:
        for one in (engine, final):
            one.answer = _valid_chat()
        assert isinstance(idp, StandInProvider) and isinstance(api, StandInApiServer)
        _GOOD_SLICES[:] = [endpoint_slice(GOOD_SLICE, [("127.0.0.1", "engine-good")], engine.port)]
        api.good = list(_GOOD_SLICES)
        api.nodes = {  # the nodes hostile slices name: labels of every shape
            "node-good": orjson.dumps({"metadata": {"name": "node-good", "labels": {RACK_LABEL: "r1"}}}),
            "node-a": orjson.dumps({"metadata": {"labels": {RACK_LABEL: "x" * 100_000}}}),
            "node-b": orjson.dumps({"metadata": {"labels": [RACK_LABEL]}}),
            "node-" + "n" * 300: b"not json",
            "7": orjson.dumps({"metadata": "labels"}),
        }
        oidc = {"issuer": idp.url, "client_id": CLIENT_ID, "client_secret": CLIENT_SECRET, "timeout_s": IDP_TIMEOUT_S,
                "algorithms": ["ES256", "RS256"], "group_roles": {GROUP: {"role": "viewer"}}}  # fmt: skip
        gateway = start_gateway(
            workdir / "gw",
            pools=[static_pool("static", MODEL, [engine.url]), _pool(api)],
            policies=_policies(),
            server={"admin_token": ADMIN, "oidc": oidc},
            backends={"health_interval_s": 0.2},
            predictor={"enabled": False},
            wait_ready=False,
        )
        with running(gateway):
            yield gateway, idp, api, engine, final


def _policies() -> dict[str, Any]:
    doc = policies([])
    doc["models"][DISCOVERED_MODEL] = dict(doc["models"][MODEL])
    return doc


def _valid_chat() -> Answer:
    body = {"id": "chatcmpl-x", "object": "chat.completion", "model": MODEL,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1}}  # fmt: skip
    return Answer(200, "application/json", [orjson.dumps(body)])


def _backends(gateway: Gateway) -> dict[str, Any]:
    status, body = http_get(gateway.url + "/admin/backends", {"Authorization": f"Bearer {ADMIN}"}, timeout_s=10)
    return orjson.loads(body) if status == 200 else {}


def discovered_endpoints(gateway: Gateway) -> list[dict[str, Any]]:
    pools = _backends(gateway).get("pools", [])
    return [e for p in pools if p.get("name") == "discovered" for e in p.get("endpoints", [])]


def _is_address_url(url: str) -> bool:
    try:
        parts = urlsplit(url)
        ipaddress.ip_address(parts.hostname or "")
        port = parts.port
    except ValueError:
        return False
    return parts.scheme == "http" and port is not None and 0 < port < 65536 and parts.path in ("", "/")


def chat(gateway: Gateway, model: str) -> int:
    body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    return http_call(gateway.port, "POST", "/v1/chat/completions", headers, body)[0]


def rss_bytes(gateway: Gateway) -> int:
    for line in Path(f"/proc/{gateway.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


@dataclass
class Tally:
    console: dict[int, int] = field(default_factory=dict)
    chats: dict[str, dict[int, int]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    sessions_from_invalid: int = 0
    valid_refused: int = 0
    valid_logins: int = 0
    examples: int = 0
    scripts_sent: int = 0

    def count(self, table: dict[int, int], status: int) -> None:
        table[status] = table.get(status, 0) + 1


def _error_shaped(body: bytes) -> bool:
    with contextlib.suppress(orjson.JSONDecodeError):
        found = orjson.loads(body)
        return isinstance(found, dict) and isinstance(found.get("error"), dict) and "code" in found["error"]
    return False


def login_once(gateway: Gateway, idp: StandInProvider, login: Login, kinds: tuple[str, str, str], tally: Tally) -> None:
    """The browser's side of one login against the provider's drawn answers; what it saw, judged."""
    idp.discovery, idp.jwks = login.discovery, login.jwks
    status, headers, body = http_call(gateway.port, "GET", "/ui/oidc/login")
    tally.count(tally.console, status)
    if status not in CONSOLE_STATUSES or (status != 302 and not _error_shaped(body)):
        tally.failures.append(f"login start {status} {body[:200]!r} ({login.why})")
        return
    if status != 302:
        return
    location = dict(headers).get("Location", "")
    query = {k: v[0] for k, v in parse_qs(urlsplit(location).query).items()}
    flow = cookies_set(headers).get("tokenway_oidc", "")
    state, nonce = query.get("state", ""), query.get("nonce", "")
    idp.token = login.token(nonce)
    cookie_kind = kinds[2]
    cookie = {"right": flow, "missing": "", "other": "x" * 43, "bytes": "\udcff\udcfe" + flow}[cookie_kind]
    headers_out = {"Cookie": f"tokenway_oidc={cookie}"} if cookie else {}
    status, headers, body = http_call(gateway.port, "GET", _callback_target(state, "", kinds), headers_out)
    tally.count(tally.console, status)
    session = "tokenway_console" in cookies_set(headers)
    valid = login.valid if kinds == ("right", "right", "right") else False
    if status not in CONSOLE_STATUSES or (status not in (302, 303) and not _error_shaped(body)):
        tally.failures.append(f"callback {status} {body[:200]!r} ({login.why}, {kinds})")
    if session and valid is False:
        tally.sessions_from_invalid += 1
        tally.failures.append(f"a session from an invalid login ({login.why}, {kinds})")
    if valid is True:
        tally.valid_logins += 1
        if not session:
            tally.valid_refused += 1
            tally.failures.append(f"a valid login refused: {status} {body[:200]!r}")


def fuzz(
    gateway: Gateway, idp: StandInProvider, api: StandInApiServer, *, examples: int, seed: int | None, phase: bool
) -> Tally:
    tally = Tally()

    @fuzz_settings(examples, seed)
    @given(st.data(), callbacks(), scripts())
    def probe(data: st.DataObject, kinds: tuple[str, str, str], script: Script) -> None:
        tally.examples += 1
        login = data.draw(logins(idp, phase))
        served_at = api.send(script)
        tally.scripts_sent += 1
        login_once(gateway, idp, login, kinds, tally)
        for model in (MODEL, DISCOVERED_MODEL):
            status = chat(gateway, model)
            tally.count(tally.chats.setdefault(model, {}), status)
            if status != 200:
                tally.failures.append(f"chat to {model}: {status}")
        until(lambda: api.served_scripts >= served_at, timeout_s=5, interval_s=0.01)

    probe()
    return tally


def _ready(gateway: Gateway, url: str) -> bool:
    return any(e.get("url") == url and e.get("state") == "ready" for e in discovered_endpoints(gateway))


def run(workdir: Path, *, examples: int = 600, seed: int | None = None) -> dict[str, Any]:
    """A tenth of the examples against a gateway still reading discovery documents, the rest against
    one that has a valid one; the API server's scripts through both."""
    results: dict[str, Any] = {"examples": 0, "seed": seed, "console": {}, "chats": {}, "failures": 0,
                               "failure_examples": [], "sessions_from_invalid": 0, "valid_refused": 0,
                               "valid_logins": 0, "unexpected_in_log": 0, "tracebacks": 0, "rss_growth_bytes": 0,
                               "bad_endpoints": 0, "endpoints_over_bound": 0, "final_applied": True,
                               "final_chat": 200, "watch_lists": 0}  # fmt: skip
    started_s = time.monotonic()
    first = max(1, examples // 10)
    for index, (count, phase) in enumerate(((first, True), (examples - first, False))):
        if count <= 0:
            continue
        with started(workdir / f"phase-{index}") as (gateway, idp, api, engine, final):
            good_url = f"http://127.0.0.1:{engine.port}"
            if not until(lambda: _ready(gateway, good_url), timeout_s=30):  # noqa: B023
                raise RuntimeError(f"the good slice never became a ready endpoint:\n{gateway.log()[-3000:]}")
            rss_before = rss_bytes(gateway)
            tally = fuzz(gateway, idp, api, examples=count, seed=seed, phase=phase)
            # afterwards: a valid slice, sent on a clean watch, is applied and serves
            api.good = [*_GOOD_SLICES, endpoint_slice(FINAL_SLICE, [("127.0.0.1", "engine-final")], final.port)]
            api.send(Script(lines=[event_line("ADDED", api.good[-1])]))
            final_url = f"http://127.0.0.1:{final.port}"
            applied = until(lambda: _ready(gateway, final_url), timeout_s=30)  # noqa: B023
            endpoints = discovered_endpoints(gateway)
            final_chat = chat(gateway, DISCOVERED_MODEL)
            log = gateway.log()
            results["rss_growth_bytes"] = max(results["rss_growth_bytes"], rss_bytes(gateway) - rss_before)
            results["examples"] += tally.examples
            for status, n in tally.console.items():
                results["console"][status] = results["console"].get(status, 0) + n
            for model, table in tally.chats.items():
                for status, n in table.items():
                    key = f"{model} {status}"
                    results["chats"][key] = results["chats"].get(key, 0) + n
            results["failures"] += len(tally.failures)
            results["failure_examples"] = (results["failure_examples"] + tally.failures[:5])[:8]
            results["sessions_from_invalid"] += tally.sessions_from_invalid
            results["valid_refused"] += tally.valid_refused
            results["valid_logins"] += tally.valid_logins
            results["unexpected_in_log"] += unexpected_errors(log)
            results["tracebacks"] += log.count("Traceback")
            results["bad_endpoints"] += sum(1 for e in endpoints if not _is_address_url(str(e.get("url"))))
            results["endpoints_over_bound"] += max(0, len(endpoints) - MAX_ENDPOINTS)
            results["final_applied"] = results["final_applied"] and applied
            results["final_chat"] = final_chat if final_chat != 200 else results["final_chat"]
            results["watch_lists"] += api.lists
            results.setdefault("provider_served", {})
            for what, n in idp.served.items():
                results["provider_served"][what] = results["provider_served"].get(what, 0) + n
            if results["tracebacks"] and "traceback_example" not in results:
                at = log.find("Traceback")
                results["traceback_example"] = log[max(0, at - 300) : at + 1500]
    results["console"] = dict(sorted(results["console"].items()))
    results["chats"] = dict(sorted(results["chats"].items()))
    results["seconds"] = round(time.monotonic() - started_s, 1)
    return results


def met(r: dict[str, Any]) -> bool:
    return bool(
        r["failures"] == 0
        and r["sessions_from_invalid"] == 0
        and r["valid_refused"] == 0
        and r["unexpected_in_log"] == 0
        and r["tracebacks"] == 0
        and r["bad_endpoints"] == 0
        and r["endpoints_over_bound"] == 0
        and r["final_applied"]
        and r["final_chat"] == 200
        and r["rss_growth_bytes"] < MAX_RSS_GROWTH
    )


def section(r: dict[str, Any]) -> list[str]:
    console = ", ".join(f"{k}: {v}" for k, v in r["console"].items())
    chats = ", ".join(f"{k}: {v}" for k, v in r["chats"].items())
    seeded = schema_fuzz.seeded(r)
    lines = [
        "## An identity provider and a cluster API that answer anything (hypothesis)",
        "",
        f"{r['examples']} examples{seeded} in {r['seconds']:g} s against one `tokenway serve` with single sign-on "
        "against a stand-in OpenID Connect provider and a pool discovered from a stand-in Kubernetes API server "
        "(a tenth of them against a gateway still reading the provider's discovery document). Each example: a "
        "login through the provider's drawn answers (discovery document, JWKS and token answer broken or valid: "
        "not JSON, the wrong shapes, beyond 512 KiB, slow, keys of unknown kinds, `alg: none`, HMAC keyed by the "
        "public key, claims wrong or of the wrong type, groups as a string, a map or 30,000 entries) with the "
        "callback's `state`, `code` and flow cookie right or drawn; a drawn list or watch of the API server "
        "(slices with fields of the wrong type, ports out of range, addresses that are not addresses, 2,000 or "
        "100,000 endpoints, node labels of any shape, lines that are not JSON, cut mid-line, ERROR events of any "
        f"code, 410 loops, lists that page forever); a chat request to each pool. Console answers: {console}. "
        f"Chat answers: {chats}. Valid logins: {r['valid_logins']}; lists served: {r['watch_lists']}.",
        "",
        "| failures | sessions from invalid answers | valid logins refused | unexpected errors in the log | "
        "tracebacks | endpoints that are not addresses | endpoints over the bound | valid slice applied after | "
        "RSS growth |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: | ---: |",
        f"| {r['failures']} | {r['sessions_from_invalid']} | {r['valid_refused']} | {r['unexpected_in_log']} | "
        f"{r['tracebacks']} | {r['bad_endpoints']} | {r['endpoints_over_bound']} | "
        f"{'yes' if r['final_applied'] and r['final_chat'] == 200 else 'no'} | "
        f"{r['rss_growth_bytes'] / 2**20:.0f} MiB |",
        "",
        "Targets (no 5xx but the provider's documented 502, answers in the console's error shape, no session from "
        "an invalid answer and one from each valid one, no bug or traceback in the log, only addresses and at most "
        "`max_endpoints` discovered, the watch applying a valid slice afterwards, RSS growth under "
        f"{MAX_RSS_GROWTH // 2**20} MiB): {'met' if met(r) else '**missed**'}.",
        "",
    ]
    return lines + examples_block(r["failure_examples"])
