"""Typed keys for the objects the app factory builds (aiohttp `AppKey`: the value type travels with it)."""

from __future__ import annotations

from typing import Any

import aiohttp
from aiohttp import web

from backends.fleet import Fleet
from gateway.pipeline import Pipeline
from gateway.settings import GatewaySettings

SETTINGS = web.AppKey("settings", GatewaySettings)
SESSION = web.AppKey("upstream_session", aiohttp.ClientSession)
FLEET = web.AppKey("fleet", Fleet)
PIPELINE = web.AppKey("pipeline", Pipeline)
POLICIES = web.AppKey("policies", Any)  # the hot-reload holder: `.current` is the live Policy
