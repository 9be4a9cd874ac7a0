"""The reservation-stage profile (`bench.overhead.script_stages`) cuts reserve.lua where its own lines
say: an edit of the script that moves one of them fails here, not as a bench that quietly measures
something else."""

from __future__ import annotations

import pytest

from bench.overhead.script_stages import STAGES, stage_source


@pytest.mark.parametrize(("label", "cut"), STAGES, ids=[label for label, _ in STAGES])
def test_each_stage_is_the_script_up_to_its_line(label: str, cut: str | None) -> None:
    whole = stage_source(None)
    stage = stage_source(cut)
    if cut is None:
        assert stage == whole
        return
    assert stage.endswith("return 1\n")
    body = stage.removesuffix("return 1\n")
    assert whole.startswith(body)  # a prefix of the real script, nothing rewritten
    if cut:
        assert whole[len(body) :].startswith(cut)


def test_the_stages_come_in_the_scripts_order() -> None:
    lengths = [len(stage_source(cut)) for _, cut in STAGES[1:-1]]
    assert lengths == sorted(lengths) and len(set(lengths)) == len(lengths)


def test_a_line_the_script_no_longer_has_stops_the_bench() -> None:
    with pytest.raises(SystemExit, match="update STAGES"):
        stage_source("-- a line reserve.lua does not have")
