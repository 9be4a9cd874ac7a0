"""A request's end user, tags and run budget: read once, bounded, and a 400 for anything malformed."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.errors import InvalidRequest
from gateway.request.intake import MAX_TAGS, request_subjects
from policies.types import NO_SUBJECTS


def test_a_request_naming_nothing_shares_the_empty_value() -> None:
    assert request_subjects({}, {}, None) is NO_SUBJECTS


def test_tags_from_the_header_and_the_body_merge_sorted_and_unique() -> None:
    body = {"metadata": {"tags": ["b", "a"]}}
    subjects = request_subjects({"x-tokenway-tags": "c, a"}, body, None)
    assert subjects.tags == ("a", "b", "c")
    assert request_subjects({}, {"metadata": {"tags": "x,y"}}, None).tags == ("x", "y")  # OpenAI: strings only


@pytest.mark.parametrize(
    ("headers", "body"),
    [
        ({"x-tokenway-tags": "ok, not ok!"}, {}),
        ({"x-tokenway-tags": ",".join(f"t{i}" for i in range(MAX_TAGS + 1))}, {}),
        ({}, {"metadata": {"tags": [1]}}),
        ({}, {"metadata": {"tags": {"a": 1}}}),
        ({}, {"metadata": {"tags": ["x" * 65]}}),
        ({}, {"metadata": {"tags": [f"t{i}" for i in range(MAX_TAGS + 1)]}}),
        ({"x-tokenway-tags": "a,b,c,d,e"}, {"metadata": {"tags": ["f", "g", "h", "i"]}}),
    ],
)
def test_malformed_or_too_many_tags_are_a_400(headers: dict[str, str], body: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest):
        request_subjects(headers, body, None)


def test_the_end_user_is_bounded_like_a_program_id() -> None:
    assert request_subjects({"x-tokenway-user": "alice"}, {"user": "bob"}, None).user == "alice"
    assert request_subjects({}, {"user": "bob"}, None).user == "bob"
    assert request_subjects({}, {"safety_identifier": "carol"}, None).user == "carol"
    long = request_subjects({}, {"user": "u" * 500}, None).user
    assert long is not None and long.startswith("#") and len(long) == 33


def test_the_run_budget_header_needs_a_program_and_a_positive_amount() -> None:
    assert request_subjects({"x-tokenway-run-budget-usd": "0.5"}, {}, "run").run_usd == 0.5
    for value in ("0", "-1", "nan", "inf", "lots"):
        with pytest.raises(InvalidRequest):
            request_subjects({"x-tokenway-run-budget-usd": value}, {}, "run")
    with pytest.raises(InvalidRequest, match="name the run"):
        request_subjects({"x-tokenway-run-budget-usd": "1"}, {}, None)


def test_the_run_seconds_header_needs_a_program_and_a_positive_number_of_seconds() -> None:
    assert request_subjects({"x-tokenway-run-seconds": "90"}, {}, "run").run_s == 90.0
    for value in ("0", "-1", "nan", "inf", "soon", "1e9"):
        with pytest.raises(InvalidRequest, match="x-tokenway-run-seconds"):
            request_subjects({"x-tokenway-run-seconds": value}, {}, "run")
    with pytest.raises(InvalidRequest, match="name the run"):
        request_subjects({"x-tokenway-run-seconds": "60"}, {}, None)
