"""The walk of a request: intake → director (the fallback chain) → dispatch → accounting, with
features plugged in as hooks (`context.py`). This package imports no hook module: the app factory
(`gateway/app/factory.py`) builds the hook list and hands it in.
"""

from gateway.request.context import OPEN_GATE, Gate, Hook, Hooks, RequestContext, Reroute, Routed
from gateway.request.director import Detour, Director

__all__ = ["OPEN_GATE", "Detour", "Director", "Gate", "Hook", "Hooks", "RequestContext", "Reroute", "Routed"]
