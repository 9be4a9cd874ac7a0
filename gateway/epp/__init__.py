"""`tokenway epp`: tokenway as the endpoint picker of a Gateway API Inference Extension gateway.

Envoy-based gateways (Envoy Gateway, kgateway, Istio, GKE's gateway) call an endpoint picker over
Envoy's external-processing gRPC protocol for every request to an `InferencePool`; the picker reads
the request, chooses the model server and says so in `x-gateway-destination-endpoint`, and Envoy
sends the request there. Here tokenway's own admission, routing and SLO gate make that choice, and
the response stream is followed for usage and first-token time. See docs/scale-out.md.

Needs the optional extra `tokenway[epp]` (grpcio) and Envoy's generated types (xds-protos), which
`protocol.py` finds beside the environment (they would overwrite opentelemetry-proto's modules
inside it).
"""
