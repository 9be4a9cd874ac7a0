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

Bodies are exchanged in FULL_DUPLEX_STREAMED mode, which the protocol requires: the request body is
collected to its end, then the headers response and one body response carrying the (rewritten)
body are sent in that order; response body chunks are answered one by one with the bytes to pass on.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from gateway.epp.protos import Envoy

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


def picked(envoy: Envoy, endpoints: Sequence[str], headers: Iterable[tuple[str, str]] = ()) -> Any:
    """The request-headers response naming the picked endpoints (header and dynamic metadata)."""
    value = ",".join(endpoints)
    mutation = envoy.ext_proc.HeaderMutation(set_headers=_header_options(envoy, [(DESTINATION, value), *headers]))
    metadata = envoy.struct.Struct()
    metadata.update({LB_NAMESPACE: {DESTINATION: value}})
    return envoy.ext_proc.ProcessingResponse(
        request_headers=envoy.ext_proc.HeadersResponse(
            response=envoy.ext_proc.CommonResponse(header_mutation=mutation, clear_route_cache=True)
        ),
        dynamic_metadata=metadata,
    )


def request_body(envoy: Envoy, body: bytes) -> Any:
    """The request-body response: the whole (rewritten) body, in one streamed piece."""
    return envoy.ext_proc.ProcessingResponse(request_body=_streamed(envoy, body, True))


def response_headers(envoy: Envoy, headers: Iterable[tuple[str, str]] = ()) -> Any:
    common = envoy.ext_proc.CommonResponse()
    options = _header_options(envoy, headers)
    if options:
        common.header_mutation.CopyFrom(envoy.ext_proc.HeaderMutation(set_headers=options))
    return envoy.ext_proc.ProcessingResponse(response_headers=envoy.ext_proc.HeadersResponse(response=common))


def response_body(envoy: Envoy, body: bytes, end_of_stream: bool) -> Any:
    return envoy.ext_proc.ProcessingResponse(response_body=_streamed(envoy, body, end_of_stream))


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
