import pytest

from policies.routing.session import SessionTable, session_key
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
