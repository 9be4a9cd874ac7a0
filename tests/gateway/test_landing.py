"""`GET /` and `GET /v1`: the landing page a new operator meets at the base URL, without credentials,
linking the console, metrics and the API document, and listed in /openapi.json like every route."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import make_mocked_request

from gateway.app.factory import create_app
from gateway.app.settings import GatewaySettings
from gateway.http.openapi import operations
from gateway.http.routes import LANDING_PATHS, landing


@pytest.mark.parametrize("path", LANDING_PATHS)
async def test_the_base_urls_answer_a_landing_page_without_credentials(path: str) -> None:
    app = create_app(GatewaySettings())
    match = await app.router.resolve(make_mocked_request("GET", path, app=app))
    assert match.handler is landing  # registered bare: no guard, no key
    response = await landing(make_mocked_request("GET", path, app=app))
    assert response.status == 200 and response.content_type == "text/html"
    assert isinstance(response.body, bytes)
    page = response.body.decode()
    for link in ("/ui", "/metrics", "/openapi.json", "/v1/models"):
        assert f'href="{link}"' in page
    assert "docs/" in page
    assert "default-src 'none'" in response.headers["Content-Security-Policy"]  # nothing may run or load


def test_the_landing_routes_are_documented_as_open_meta_routes() -> None:
    ops = {(method, path): op for method, path, op in operations()}
    for path in LANDING_PATHS:
        op = ops[("GET", path)]
        assert op["x-tokenway-surface"] == "meta" and op["x-tokenway-auth"] == "none"
