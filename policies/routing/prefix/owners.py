"""Which endpoints hold which block: one dict from block key to a bitmask of endpoint slots.

Matching a prompt walks its keys once for all candidates together (O(blocks) dict lookups, not
O(candidates x blocks)): the candidates still matching are a bitmask that only shrinks, and the walk
stops when it is empty.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class SlotMap:
    """Endpoint id -> small integer slot (its bit in owner masks); freed slots are reused."""

    def __init__(self) -> None:
        self._slots: dict[str, int] = {}
        self._free: list[int] = []

    def get(self, endpoint_id: str) -> int | None:
        return self._slots.get(endpoint_id)

    def slot(self, endpoint_id: str) -> int:
        slot = self._slots.get(endpoint_id)
        if slot is None:
            slot = self._free.pop() if self._free else len(self._slots)
            self._slots[endpoint_id] = slot
        return slot

    def release(self, endpoint_id: str) -> int | None:
        slot = self._slots.pop(endpoint_id, None)
        if slot is not None:
            self._free.append(slot)
        return slot

    def ids(self) -> list[str]:
        return list(self._slots)

    def mask_of(self, endpoint_ids: Iterable[str]) -> int:
        mask = 0
        for endpoint_id in endpoint_ids:
            slot = self._slots.get(endpoint_id)
            if slot is not None:
                mask |= 1 << slot
        return mask


class OwnerMap:
    """Block key -> bitmask of the slots that hold it."""

    def __init__(self) -> None:
        self.owners: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.owners)

    def add(self, key: int, bit: int) -> None:
        owners = self.owners
        owners[key] = owners.get(key, 0) | bit

    def discard(self, key: int, bit: int) -> None:
        owners = self.owners
        mask = owners.get(key)
        if mask is None:
            return
        mask &= ~bit
        if mask:
            owners[key] = mask
        else:
            del owners[key]


def leading_matches(keys: Sequence[int], candidates_mask: int, *maps: dict[int, int]) -> dict[int, int]:
    """Matched leading blocks per slot of `candidates_mask`: slot -> count of consecutive keys held.

    A slot holds key i if its bit is set in any of `maps` (confirmed and speculative entries).
    Slots absent from the result matched nothing.
    """
    result: dict[int, int] = {}
    alive = candidates_mask
    if not alive:
        return result
    single = maps[0] if len(maps) == 1 else None
    for i, key in enumerate(keys):
        if single is not None:
            mask = single.get(key, 0)
        else:
            mask = 0
            for m in maps:
                mask |= m.get(key, 0)
        lost = alive & ~mask
        if lost:
            if i:
                while lost:
                    low = lost & -lost
                    result[low.bit_length() - 1] = i
                    lost ^= low
            alive &= mask
            if not alive:
                return result
    n = len(keys)
    while alive:
        low = alive & -alive
        result[low.bit_length() - 1] = n
        alive ^= low
    return result
