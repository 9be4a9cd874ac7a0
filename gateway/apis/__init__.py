"""The agent-era API surface beside chat completions: OpenAI Responses, Anthropic Messages,
`GET /v1/models/{id}`, and OpenAI's error shape for every unknown route.

Each API is one `ApiCall` per request (`responses.py`; an `Api` of the walk, `gateway/request/apis.py`):
how the client's body is read and estimated, what is sent to an endpoint (the body as is where the
engine serves the API, a chat completions request elsewhere), how the stream and the answer come
back, and how errors are written. The walk of a request (`gateway/request/`) calls these few
methods; translations themselves are pure functions in `backends.protocols`.
"""
