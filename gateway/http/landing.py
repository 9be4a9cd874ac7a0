"""`GET /` and `GET /v1`: a small page saying what answers here and where to go next.

A new operator's first request is often the base URL itself, in a browser or with curl; a 404 there
reads as "the gateway is broken". The page names the gateway and its version, and links the console,
the metrics, the OpenAPI document, health and readiness, and says where the documentation lives. It
is the same for every gateway (no configuration, no secret, no per-request work: the bytes are built
once), so it is served without credentials, like `/openapi.json`. `LINKS` is also what the start-up
banner prints (gateway/app/server.py).
"""

from __future__ import annotations

import html
from functools import cache
from typing import Final

from aiohttp import web

from gateway import __version__

LANDING_PATHS: Final = ("/", "/v1")
# (path, what it is): the banner prints these, the page links them
LINKS: Final = (
    ("/ui", "the web console (the admin token)"),
    ("/metrics", "Prometheus metrics"),
    ("/openapi.json", "every route of this gateway, its body and who may call it (OpenAPI 3.1)"),
    ("/v1/models", "the models your key may use (an API key)"),
    ("/healthz", "the process is alive"),
    ("/readyz", "the pools can serve"),
)
DOCS: Final = "README.md and docs/ in tokenway's source (docs/apis.md: the APIs; docs/operations.md: running it)"
# the page has no script, style sheet or form: nothing may run, load or be framed
HEADERS: Final = {
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; frame-ancestors 'none'; "
    "base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


@cache
def page() -> bytes:
    """The page's bytes (built once; the same for every gateway and request)."""
    items = "\n".join(
        f'    <li><a href="{html.escape(path)}"><code>{html.escape(path)}</code></a> — {html.escape(what)}</li>'
        for path, what in LINKS
    )
    return f"""<!doctype html>
<html lang="en">
<head>
  <meta charset="utf-8">
  <title>tokenway {html.escape(__version__)}</title>
  <style>body {{ font: 15px/1.5 system-ui, sans-serif; max-width: 46em; margin: 2em auto; padding: 0 1em; }}</style>
</head>
<body>
  <h1>tokenway {html.escape(__version__)}</h1>
  <p>A token-aware LLM API gateway. Point an OpenAI client's <code>base_url</code> (or an Anthropic
  client's) at <code>/v1</code> of this address, with an API key as the bearer token.</p>
  <ul>
{items}
  </ul>
  <p>Documentation: {html.escape(DOCS)}.</p>
</body>
</html>
""".encode()


async def landing(request: web.Request) -> web.Response:
    """`GET /`, `GET /v1`: the landing page, no credentials needed."""
    return web.Response(body=page(), headers={**HEADERS, "Content-Type": "text/html; charset=utf-8"})


def setup_landing_routes(app: web.Application) -> None:
    for path in LANDING_PATHS:
        app.router.add_get(path, landing)
