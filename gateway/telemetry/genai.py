"""OpenTelemetry GenAI semantic-convention vocabulary shared by the Prometheus and OTLP exports.

Names follow semconv `gen_ai.*` (the ones Envoy AI Gateway exports too); Prometheus names are the
OTel -> Prometheus translation (dots to underscores, unit suffix `_seconds`, `{token}` dropped).
Bucket boundaries are the semconv's advised explicit buckets, so dashboards built for other
GenAI-convention gateways read ours unchanged.
"""

from __future__ import annotations

from typing import Final

# OTel instrument names (OTLP export)
TOKEN_USAGE: Final = "gen_ai.client.token.usage"
TIME_TO_FIRST_TOKEN: Final = "gen_ai.server.time_to_first_token"
TIME_PER_OUTPUT_TOKEN: Final = "gen_ai.server.time_per_output_token"
REQUEST_DURATION: Final = "gen_ai.server.request.duration"

# Prometheus family names of the same instruments
PROM_TOKEN_USAGE: Final = "gen_ai_client_token_usage"
PROM_TIME_TO_FIRST_TOKEN: Final = "gen_ai_server_time_to_first_token_seconds"
PROM_TIME_PER_OUTPUT_TOKEN: Final = "gen_ai_server_time_per_output_token_seconds"
PROM_REQUEST_DURATION: Final = "gen_ai_server_request_duration_seconds"

# Attribute names
OPERATION_NAME: Final = "gen_ai.operation.name"
PROVIDER_NAME: Final = "gen_ai.provider.name"
SYSTEM: Final = "gen_ai.system"  # deprecated alias of provider.name; older backends still read it
REQUEST_MODEL: Final = "gen_ai.request.model"
RESPONSE_MODEL: Final = "gen_ai.response.model"
TOKEN_TYPE: Final = "gen_ai.token.type"
USAGE_INPUT_TOKENS: Final = "gen_ai.usage.input_tokens"
USAGE_OUTPUT_TOKENS: Final = "gen_ai.usage.output_tokens"
USAGE_CACHE_READ_INPUT_TOKENS: Final = "gen_ai.usage.cache_read.input_tokens"
REQUEST_STREAM: Final = "gen_ai.request.stream"
ERROR_TYPE: Final = "error.type"

# gen_ai.token.type values: semconv defines `input` and `output` only (gen-ai-metrics.md, v1.41.0,
# https://opentelemetry.io/docs/specs/semconv/gen-ai/gen-ai-metrics/). The cached part of the input is
# not a token type (it is part of `input`: summing the types would count it twice); it is exported
# on its own, as tokenway_cached_input_tokens_total.
TOKEN_INPUT: Final = "input"
TOKEN_OUTPUT: Final = "output"

# RequestRecord.api -> gen_ai.operation.name
OPERATION_BY_API: Final[dict[str, str]] = {
    "chat": "chat",
    "completions": "text_completion",
    "embeddings": "embeddings",
    "responses": "chat",
    "messages": "chat",
}

# semconv advised buckets (TPOT extended downwards)
TOKEN_USAGE_BUCKETS: Final = (
    1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864,
)  # fmt: skip
TIME_TO_FIRST_TOKEN_BUCKETS_S: Final = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
)  # fmt: skip
# Extended below 10 ms: a small model on a current GPU decodes at 5-8 ms per token.
TIME_PER_OUTPUT_TOKEN_BUCKETS_S: Final = (
    0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip
REQUEST_DURATION_BUCKETS_S: Final = (
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
)  # fmt: skip


def operation_name(api: str) -> str:
    return OPERATION_BY_API.get(api, api or "chat")
