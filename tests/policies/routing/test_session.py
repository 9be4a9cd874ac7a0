import pytest

from policies.routing.pipeline import SessionTable, session_key
from tests.policies.routing.factories import facts


@pytest.mark.parametrize(
    ("header", "user", "use_user", "expected"),
    [
        pytest.param("s1", None, True, "p\x00s1", id="header"),
        pytest.param(None, "alice", True, "p\x00alice", id="user-field"),
        pytest.param("s1", "alice", True, "p\x00s1", id="header-wins"),
        pytest.param(None, "alice", False, None, id="user-field-disabled"),
        pytest.param(None, None, True, None, id="none"),
    ],
)
def test_session_key(header: str | None, user: str | None, use_user: bool, expected: str | None) -> None:
    assert session_key(facts(session_key=header, user=user), "p", use_user) == expected


def test_table_is_bounded_lru() -> None:
    table = SessionTable(max_sessions=2)
    table.pin("a", "e0")
    table.pin("b", "e1")
    assert table.get("a") == "e0"  # touch a: b is now the oldest
    table.pin("a", "e0")
    table.pin("c", "e2")
    assert (table.get("a"), table.get("b"), table.get("c"), len(table)) == ("e0", None, "e2", 2)
    table.pin(None, "e3")
    assert table.get(None) is None


@pytest.mark.parametrize(
    ("header", "user"),
    [
        pytest.param("s" * 100_000, None, id="long-header"),
        pytest.param(None, "u" * 100_000, id="long-user"),
        pytest.param("bad-\udcff-bytes", None, id="undecodable"),
    ],
)
def test_long_or_undecodable_session_keys_are_kept_as_a_fixed_size_hash(header: str | None, user: str | None) -> None:
    key = session_key(facts(session_key=header, user=user), "p", True)
    assert key is not None and len(key) == len("p\x00#") + 32
    key.encode("utf-8")  # storable, loggable
    assert session_key(facts(session_key=header, user=user), "p", True) == key  # same session, same pin
    other = session_key(facts(session_key=(header or user or "") + "x"), "p", True)
    assert other != key


def test_the_table_is_bounded_in_bytes_for_any_client_keys() -> None:
    table = SessionTable(max_sessions=100)
    for i in range(1000):
        table.pin(session_key(facts(user=f"{i}-" + "u" * 100_000), "p", True), "e0")
    assert len(table) == 100
    assert table.key_chars == 100 * (len("p\x00#") + 32)
