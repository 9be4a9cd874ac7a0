"""The endpoint-picker protocol on top of Envoy's ext_proc messages: what is read, what is answered.

From the Gateway API Inference Extension's protocol (docs/proposals/004-endpoint-picker-protocol):

- the picked endpoints go back both as the request header `x-gateway-destination-endpoint` and as
  dynamic metadata `{"envoy.lb": {"x-gateway-destination-endpoint": "ip:port[,ip:port...]"}}`
  (the same value in both; Envoy tries them in order when retries are configured);
- the data plane may restrict the choice with filter metadata
  `{"envoy.lb.subset_hint": {"x-gateway-destination-endpoint-subset": ["ip:port", ...]}}`: only
  those may be picked, and none eligible is a 503;
- no ready endpoint is an ImmediateResponse 503; a request to drop (shed) a 429;
- on the response, `{"envoy.lb": {"x-gateway-destination-endpoint-served": "ip:port"}}` in the
  request's metadata context names the endpoint that really served (after Envoy's retries).

Bodies: the Inference Extension's gateways configure ext_proc with `FULL_DUPLEX_STREAMED` bodies
(and trailers `SEND`, which that mode requires): the request body is collected to its end, then the
headers response and one body response carrying the body to send on go back in that order (in this
mode the body Envoy forwards is only what the picker sends back, and Envoy drops `content-length`
itself); response body chunks are answered one by one with the bytes to pass on. A data plane
configured with `BUFFERED` request bodies (Envoy waits for the headers response before it sends the
body) gets its headers answered at once and the pick, the body mutation (only when the body changed)
and the new `content-length` in the body response, as processing_mode.proto asks of a processor in
that mode. Envoy announces its modes in the first message (`protocol_config`); `epp.request_body_mode`
says which to assume when it does not. Other request body modes cannot carry a pick made from the
body and are refused.

## Envoy's generated types (`Envoy`, `envoy`)

Envoy's generated Python types (PyPI `xds-protos`), found where they can be imported safely.

xds-protos bundles, besides Envoy's API, generated copies of the protos Envoy depends on, among
them OpenTelemetry's (`opentelemetry/proto/...`) at an older version. Installed into the same
environment as `opentelemetry-proto`, whichever installs last owns those files; with xds-protos
last, the OTLP exporter fails to import (`InstrumentationScope`). So the project installs it into
its own folder (`make install`: `.venv/xds-protos`, only its `envoy`, `xds`, `udpa` and `validate`
packages kept) and this module appends that folder to `sys.path` when Envoy's types are first
needed. `TOKENWAY_XDS_PROTOS` names another folder; an environment where `envoy` already imports
is used as it is.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

ENV_VAR = "TOKENWAY_XDS_PROTOS"
KEEP = ("envoy", "xds", "udpa", "validate")


def candidates() -> list[Path]:
    found = []
    if os.environ.get(ENV_VAR):
        found.append(Path(os.environ[ENV_VAR]))
    found.append(Path(sys.prefix) / "xds-protos")
    return found


class Envoy:
    """The modules the endpoint picker uses, imported once."""

    def __init__(self) -> None:
        ext_proc, ext_proc_grpc, base, http_status, struct = _import()
        self.ext_proc: Any = ext_proc
        self.ext_proc_grpc: Any = ext_proc_grpc
        self.base: Any = base
        self.http_status: Any = http_status
        self.struct: Any = struct


def _import() -> tuple[ModuleType, ...]:
    try:
        return _modules()
    except ImportError:
        pass
    for folder in candidates():
        if (folder / "envoy").is_dir() and str(folder) not in sys.path:
            sys.path.append(str(folder))  # last: never shadows the environment's own packages
            try:
                return _modules()
            except ImportError:
                continue
    raise ImportError(
        "Envoy's ext_proc types (xds-protos) were not found: run `make install`, or "
        f"`pip install --no-deps --target DIR xds-protos` and set {ENV_VAR}=DIR (see gateway/epp/protocol.py)"
    )


def _modules() -> tuple[ModuleType, ...]:
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2, external_processor_pb2_grpc
    from envoy.type.v3 import http_status_pb2
    from google.protobuf import struct_pb2

    return external_processor_pb2, external_processor_pb2_grpc, base_pb2, http_status_pb2, struct_pb2


@functools.cache
def envoy() -> Envoy:
    return Envoy()


DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"


def headers_of(http_headers: Any) -> dict[str, str]:
    """An HttpHeaders message as a dict (lower-case names; Envoy sends values in `raw_value`)."""
    out: dict[str, str] = {}
    for header in http_headers.headers.headers:
        value = header.raw_value.decode("utf-8", "replace") if header.raw_value else header.value
        out[header.key.lower()] = value
    return out


def _metadata_value(request: Any, namespace: str, key: str) -> Any:
    metadata = request.metadata_context.filter_metadata
    if namespace not in metadata:
        return None
    fields = metadata[namespace].fields
    return fields.get(key)


def subset_hint(request: Any) -> list[str] | None:
    """The endpoints the data plane allows for this request, or None when it does not restrict."""
    value = _metadata_value(request, SUBSET_NAMESPACE, SUBSET)
    if value is None:
        return None
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        return [v.string_value for v in value.list_value.values if v.WhichOneof("kind") == "string_value"]
    if kind == "string_value":
        return [part.strip() for part in value.string_value.split(",") if part.strip()]
    return []


def served_endpoint(request: Any) -> str | None:
    value = _metadata_value(request, LB_NAMESPACE, SERVED)
    return value.string_value if value is not None and value.WhichOneof("kind") == "string_value" else None


def _header_options(envoy: Envoy, headers: Iterable[tuple[str, str]]) -> list[Any]:
    return [
        envoy.base.HeaderValueOption(header=envoy.base.HeaderValue(key=k, raw_value=v.encode())) for k, v in headers
    ]


# ProcessingMode.BodySendMode (envoy/extensions/filters/http/ext_proc/v3/processing_mode.proto)
NONE, STREAMED, BUFFERED, BUFFERED_PARTIAL, FULL_DUPLEX_STREAMED = 0, 1, 2, 3, 4
MODE_NAMES = {
    NONE: "NONE",
    STREAMED: "STREAMED",
    BUFFERED: "BUFFERED",
    BUFFERED_PARTIAL: "BUFFERED_PARTIAL",
    FULL_DUPLEX_STREAMED: "FULL_DUPLEX_STREAMED",
}
MODE_BY_NAME = {name: mode for mode, name in MODE_NAMES.items()}
CONTENT_LENGTH = "content-length"


def body_modes(message: Any) -> tuple[int, int] | None:
    """(request, response) body modes Envoy announced in `protocol_config` (its first message), or
    None where it sent none (older Envoys)."""
    if not message.HasField("protocol_config"):
        return None
    config = message.protocol_config
    return int(config.request_body_mode), int(config.response_body_mode)


def _destination(envoy: Envoy, endpoints: Sequence[str]) -> tuple[str, Any]:
    value = ",".join(endpoints)
    metadata = envoy.struct.Struct()
    metadata.update({LB_NAMESPACE: {DESTINATION: value}})
    return value, metadata


def picked(
    envoy: Envoy, endpoints: Sequence[str], headers: Iterable[tuple[str, str]] = (), *, body_changed: bool = False
) -> Any:
    """The request-headers response naming the picked endpoints (header and dynamic metadata);
    FULL_DUPLEX_STREAMED: the body follows in its own response. A changed body's length is not the
    client's: `content-length` goes (Envoy removes it too in this mode)."""
    value, metadata = _destination(envoy, endpoints)
    mutation = envoy.ext_proc.HeaderMutation(
        set_headers=_header_options(envoy, [(DESTINATION, value), *headers]),
        remove_headers=[CONTENT_LENGTH] if body_changed else [],
    )
    return envoy.ext_proc.ProcessingResponse(
        request_headers=envoy.ext_proc.HeadersResponse(
            response=envoy.ext_proc.CommonResponse(header_mutation=mutation, clear_route_cache=True)
        ),
        dynamic_metadata=metadata,
    )


def request_body(envoy: Envoy, body: bytes, end_of_stream: bool = True) -> Any:
    """FULL_DUPLEX_STREAMED: the request-body response, the whole body to send on in one piece."""
    return envoy.ext_proc.ProcessingResponse(request_body=_streamed(envoy, body, end_of_stream))


def headers_continue(envoy: Envoy) -> Any:
    """BUFFERED: the request headers answered before the body comes (the pick goes with the body)."""
    return envoy.ext_proc.ProcessingResponse(
        request_headers=envoy.ext_proc.HeadersResponse(response=envoy.ext_proc.CommonResponse())
    )


def picked_with_body(
    envoy: Envoy,
    endpoints: Sequence[str],
    headers: Iterable[tuple[str, str]],
    body: bytes,
    *,
    body_changed: bool,
) -> Any:
    """BUFFERED: the request-body response carrying the pick (header, metadata) and, only when the body
    changed, the new body with its `content-length` (the processor's duty in this mode: a mismatch is
    a local reply from Envoy)."""
    value, metadata = _destination(envoy, endpoints)
    added = [(DESTINATION, value), *headers]
    if body_changed:
        added.append((CONTENT_LENGTH, str(len(body))))
    common = envoy.ext_proc.CommonResponse(
        header_mutation=envoy.ext_proc.HeaderMutation(set_headers=_header_options(envoy, added)),
        clear_route_cache=True,
    )
    if body_changed:
        common.body_mutation.CopyFrom(envoy.ext_proc.BodyMutation(body=body))
    return envoy.ext_proc.ProcessingResponse(
        request_body=envoy.ext_proc.BodyResponse(response=common), dynamic_metadata=metadata
    )


def response_headers(envoy: Envoy, headers: Iterable[tuple[str, str]] = ()) -> Any:
    common = envoy.ext_proc.CommonResponse()
    options = _header_options(envoy, headers)
    if options:
        common.header_mutation.CopyFrom(envoy.ext_proc.HeaderMutation(set_headers=options))
    return envoy.ext_proc.ProcessingResponse(response_headers=envoy.ext_proc.HeadersResponse(response=common))


def response_body(envoy: Envoy, body: bytes, end_of_stream: bool, *, mode: int, original: bytes = b"") -> Any:
    """A response-body chunk answered: FULL_DUPLEX_STREAMED sends on exactly `body`; the other modes
    keep the chunk (`original`) when it is unchanged and replace it otherwise, BUFFERED with the new
    `content-length` (its headers are still held; STREAMED has Envoy drop it)."""
    if mode == FULL_DUPLEX_STREAMED:
        return envoy.ext_proc.ProcessingResponse(response_body=_streamed(envoy, body, end_of_stream))
    common = envoy.ext_proc.CommonResponse()
    if body != original:
        mutation = envoy.ext_proc.BodyMutation(body=body) if body else envoy.ext_proc.BodyMutation(clear_body=True)
        common.body_mutation.CopyFrom(mutation)
        if mode == BUFFERED:
            length = _header_options(envoy, [(CONTENT_LENGTH, str(len(body)))])
            common.header_mutation.CopyFrom(envoy.ext_proc.HeaderMutation(set_headers=length))
    return envoy.ext_proc.ProcessingResponse(response_body=envoy.ext_proc.BodyResponse(response=common))


def trailers(envoy: Envoy, *, request: bool) -> Any:
    """Trailers (FULL_DUPLEX_STREAMED sends them, the end of that side) answered unchanged."""
    answer = envoy.ext_proc.TrailersResponse()
    if request:
        return envoy.ext_proc.ProcessingResponse(request_trailers=answer)
    return envoy.ext_proc.ProcessingResponse(response_trailers=answer)


def _streamed(envoy: Envoy, body: bytes, end_of_stream: bool) -> Any:
    streamed = envoy.ext_proc.StreamedBodyResponse(body=body, end_of_stream=end_of_stream)
    return envoy.ext_proc.BodyResponse(
        response=envoy.ext_proc.CommonResponse(body_mutation=envoy.ext_proc.BodyMutation(streamed_response=streamed))
    )


def immediate(
    envoy: Envoy, status: int, body: bytes, headers: Iterable[tuple[str, str]] = (), details: str = ""
) -> Any:
    """Answer the client now (an error in the API's own shape), without any model server."""
    options = _header_options(envoy, [("content-type", "application/json"), *headers])
    return envoy.ext_proc.ProcessingResponse(
        immediate_response=envoy.ext_proc.ImmediateResponse(
            status=envoy.http_status.HttpStatus(code=status),
            headers=envoy.ext_proc.HeaderMutation(set_headers=options),
            body=body,
            details=details,
        )
    )
