"""The gateway runs without its optional extras: `kubernetes` (discovery) and `grpc` / Envoy's
types (`tokenway epp`) are imported only by the features that need them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.procs import REPO

pytestmark = pytest.mark.e2e  # starts a Python without the extras

BLOCK = (
    "import sys\n"
    "for name in ('kubernetes', 'grpc', 'envoy', 'xds', 'udpa', 'validate'):\n"
    "    sys.modules[name] = None\n"
)


def test_gateway_imports_and_builds_without_the_extras() -> None:
    code = BLOCK + (
        "from gateway.app.settings import GatewaySettings\n"
        "from gateway.app.factory import create_app\n"
        "import gateway.app.cli\n"
        "create_app(GatewaySettings())\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr
