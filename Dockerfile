# tokenway: the gateway and its simulated engine in one image.
#   docker build -t tokenway .
#   docker run -p 8080:8080 -e TOKENWAY_ADMIN_TOKEN=$(openssl rand -hex 16) tokenway
#                                  # simulated GPUs, demo key tw-demo-key-0000, console at /ui with that token
# The image ships deploy/image/gateway.yaml and config/policies.yaml as /etc/tokenway/; mount your own
# over them (docker compose does). State (ledger, keys database, models) lives under /var/lib/tokenway.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY . /src
# `plot` adds matplotlib for `tokenway usage report --plot`; `k8s` the client for EndpointSlice
# discovery (deploy/k8s); `epp` gRPC for `tokenway epp`, whose Envoy types (xds-protos) go beside the
# environment: they would overwrite opentelemetry-proto's modules (gateway/epp/protocol.py)
ENV TOKENWAY_XDS_PROTOS=/opt/xds-protos
RUN pip install ".[plot,k8s,epp]" \
    && pip install --no-deps --target /opt/xds-protos "xds-protos>=1.62" \
    && cd /opt/xds-protos && find . -maxdepth 1 -mindepth 1 ! -name envoy ! -name xds ! -name udpa ! -name validate \
       ! -name 'xds_protos-*' -exec rm -rf {} + && cd / \
    && useradd --system --uid 10001 --home-dir /var/lib/tokenway tokenway \
    && mkdir -p /var/lib/tokenway/usage /etc/tokenway \
    && cp deploy/image/gateway.yaml config/policies.yaml /etc/tokenway/ \
    && chown -R tokenway /var/lib/tokenway

USER tokenway
WORKDIR /var/lib/tokenway
EXPOSE 8080
ENTRYPOINT ["tokenway"]
CMD ["serve", "--config", "/etc/tokenway/gateway.yaml"]
