"""Envoy's generated Python types (PyPI `xds-protos`), found where they can be imported safely.

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
        f"`pip install --no-deps --target DIR xds-protos` and set {ENV_VAR}=DIR (see gateway/epp/protos.py)"
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
