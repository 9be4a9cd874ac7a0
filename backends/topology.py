"""Where an endpoint sits: node, rack (an NVLink domain or a top-of-rack switch), zone; and the link
class between two endpoints.

A KV transfer between a prefill and a decode replica crosses the fastest link the two share: the
node's NVLink / PCIe fabric when both are on one node, the rack's switch when both are in one rack,
the spine between racks, the provider's network between zones. Routing prices that transfer
(`policies/routing/topology.py`); this module only says which class of link it is.

Labels come from config (`topology:` of a static endpoint, or of a pool for its launched replicas)
or from Kubernetes (the EndpointSlice's `nodeName` and `zone`, and a rack label of the node).
A missing label is unknown, never "the same": an endpoint without any label has no link class
to anything, and routing then charges no transfer (topology-blind, as before labels existed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

SAME_NODE: Final = "same_node"
SAME_RACK: Final = "same_rack"
CROSS_RACK: Final = "cross_rack"
CROSS_ZONE: Final = "cross_zone"
LINK_CLASSES: Final = (SAME_NODE, SAME_RACK, CROSS_RACK, CROSS_ZONE)  # fastest first

LinkClass = Literal["same_node", "same_rack", "cross_rack", "cross_zone"]


@dataclass(frozen=True, slots=True)
class Topology:
    """An endpoint's topology labels; None: not known."""

    node: str | None = None
    rack: str | None = None
    zone: str | None = None

    @property
    def known(self) -> bool:
        return self.node is not None or self.rack is not None or self.zone is not None


UNKNOWN: Final = Topology()


def link_class(a: Topology, b: Topology) -> LinkClass | None:
    """The class of the fastest link between two endpoints; None when either has no labels.

    Same node beats same rack; two endpoints whose zones differ are cross-zone whatever else they
    say; otherwise different (or unknown) nodes outside a shared rack are cross-rack, the
    conservative reading of "not shown to share a rack"."""
    if not a.known or not b.known:
        return None
    if a.node is not None and a.node == b.node:
        return SAME_NODE
    if a.zone is not None and b.zone is not None and a.zone != b.zone:
        return CROSS_ZONE
    if a.rack is not None and a.rack == b.rack:
        return SAME_RACK
    return CROSS_RACK
