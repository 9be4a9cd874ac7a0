import pytest

from policies.routing.prefix_blocks import OwnerMap, SlotMap, leading_matches


def owner_map(holdings: dict[int, list[int]]) -> dict[int, int]:
    """slot -> keys held, as a key -> mask dict."""
    owners = OwnerMap()
    for slot, keys in holdings.items():
        for key in keys:
            owners.add(key, 1 << slot)
    return owners.owners


@pytest.mark.parametrize(
    ("holdings", "mask", "expected"),
    [
        pytest.param({0: [1, 2, 3], 1: [1, 2]}, 0b11, {0: 3, 1: 2}, id="consecutive-prefixes"),
        pytest.param({0: [1, 3]}, 0b1, {0: 1}, id="hole-stops-match"),
        pytest.param({0: [2, 3]}, 0b1, {}, id="first-block-missing"),
        pytest.param({0: [1, 2, 3], 1: [1, 2, 3]}, 0b01, {0: 3}, id="only-candidates"),
        pytest.param({}, 0, {}, id="no-candidates"),
    ],
)
def test_leading_matches(holdings: dict[int, list[int]], mask: int, expected: dict[int, int]) -> None:
    assert leading_matches([1, 2, 3], mask, owner_map(holdings)) == expected


def test_leading_matches_unions_maps() -> None:
    confirmed = owner_map({0: [1]})
    speculative = owner_map({0: [2, 3]})
    assert leading_matches([1, 2, 3], 0b1, confirmed, speculative) == {0: 3}


def test_owner_map_discard_removes_empty_keys() -> None:
    owners = OwnerMap()
    owners.add(7, 0b1)
    owners.add(7, 0b10)
    owners.discard(7, 0b1)
    assert owners.owners == {7: 0b10}
    owners.discard(7, 0b10)
    owners.discard(8, 0b1)
    assert len(owners) == 0


def test_slot_map_reuses_released_slots() -> None:
    slots = SlotMap()
    assert (slots.slot("a"), slots.slot("b"), slots.slot("a")) == (0, 1, 0)
    slots.release("a")
    assert slots.slot("c") == 0
    assert slots.mask_of(["b", "c", "unknown"]) == 0b11
