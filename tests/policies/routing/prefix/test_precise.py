import pytest

from backends.kv_events import RESET_GAP, RESET_RESTART, BlockStored
from policies.routing.prefix_blocks import ENGINE_HASHERS, HashedPrompt
from policies.routing.prefix_precise import PrecisePrefixIndex, salt_from_extra_keys
from tests.policies.routing.factories import NOW_S, endpoint, facts, prompt, token_ids
from tests.policies.routing.prefix.events import batch, cleared, removed, stored

PROMPT = token_ids(160)  # 10 blocks of 16


def index(**kw: object) -> PrecisePrefixIndex:
    kw.setdefault("engine_hashers", ENGINE_HASHERS)
    return PrecisePrefixIndex(**kw)  # type: ignore[arg-type]


@pytest.fixture(params=["sim", "vllm"], ids=["engine-hash-keys", "token-keys"])
def engine(request: pytest.FixtureRequest) -> str:
    """`sim`: matched by the engine's own hashes; `vllm`: by keys re-derived from event token ids."""
    return str(request.param)


@pytest.mark.parametrize(
    ("events", "expected_cached"),
    [
        pytest.param([stored(PROMPT)], 159, id="all-blocks-stored"),
        pytest.param([stored(PROMPT[:96])], 96, id="prefix-stored"),
        pytest.param([stored(PROMPT[:96]), stored(PROMPT, first_block=6)], 159, id="chained-events"),
        pytest.param([stored(PROMPT), removed(PROMPT, [9])], 144, id="tail-removed"),
        pytest.param([stored(PROMPT), removed(PROMPT, [4])], 64, id="middle-removed-breaks-chain"),
        pytest.param([stored(PROMPT), removed(PROMPT, [0])], 0, id="head-removed"),
        pytest.param([stored(PROMPT), cleared()], 0, id="all-cleared"),
        pytest.param([stored(PROMPT, medium="CPU"), removed(PROMPT, [9], medium="GPU")], 159, id="offloaded-hits"),
        pytest.param([stored(PROMPT, medium="CPU"), removed(PROMPT, [9], medium="CPU")], 144, id="offloaded-removed"),
    ],
)
def test_follows_events(engine: str, events: list[object], expected_cached: int) -> None:
    idx = index()
    e = endpoint("a", engine=engine)
    idx.apply("a", batch(*events))  # type: ignore[arg-type]
    assert idx.lookup(prompt(PROMPT), [e], NOW_S) == [expected_cached]


def test_orphan_blocks_only_matchable_by_engine_hash() -> None:
    idx = index()
    sim, vllm = endpoint("sim", engine="sim"), endpoint("vllm", engine="vllm")
    for name in ("sim", "vllm"):
        idx.apply(name, batch(stored(PROMPT, first_block=0)))
        idx.apply(name, batch(cleared()))
        idx.apply(name, batch(stored(PROMPT[:32]), stored(PROMPT, first_block=2)))
    assert idx.lookup(prompt(PROMPT), [sim, vllm], NOW_S) == [159, 159]
    fresh = index()
    fresh.apply("vllm", batch(stored(PROMPT, first_block=2)))  # parent never seen
    fresh.apply("sim", batch(stored(PROMPT, first_block=2)))
    assert fresh.stats(NOW_S)["vllm"].orphans == 8
    assert fresh.lookup(prompt(PROMPT), [sim, vllm], NOW_S) == [0, 0]  # block 0 unknown either way


@pytest.mark.parametrize(
    ("engine", "publish_salt", "request_salt", "expected"),
    [
        pytest.param("sim", False, "s1", 159, id="sim-hash-includes-salt"),
        pytest.param("sim", False, None, 0, id="sim-unsalted-request-misses"),
        pytest.param("vllm", True, "s1", 159, id="token-keys-salt-from-extra-keys"),
        pytest.param("vllm", True, None, 0, id="token-keys-unsalted-misses"),
        pytest.param("vllm", False, "s1", 0, id="token-keys-unpublished-salt-misses"),
    ],
)
def test_cache_salt(engine: str, publish_salt: bool, request_salt: str | None, expected: int) -> None:
    idx = index()
    idx.apply("a", batch(stored(PROMPT, salt="s1", publish_salt=publish_salt)))
    assert idx.lookup(prompt(PROMPT, cache_salt=request_salt), [endpoint("a", engine=engine)], NOW_S) == [expected]


def test_speculative_entries_cover_the_gap_until_ttl(engine: str) -> None:
    idx = index(speculative_ttl_s=2.0)
    a, b = endpoint("a", engine=engine), endpoint("b", engine=engine)
    idx.apply("a", batch())
    idx.apply("b", batch())
    idx.record(prompt(PROMPT), a, NOW_S)
    assert idx.lookup(prompt(PROMPT), [a, b], NOW_S + 1.0) == [159, 0]
    assert idx.lookup(prompt(PROMPT), [a, b], NOW_S + 2.5) == [0, 0]


def test_event_confirms_speculative_entry(engine: str) -> None:
    idx = index(speculative_ttl_s=2.0)
    a = endpoint("a", engine=engine)
    idx.apply("a", batch())
    idx.record(prompt(PROMPT), a, NOW_S)
    idx.apply("a", batch(stored(PROMPT), at_s=NOW_S + 0.5))
    assert idx.lookup(prompt(PROMPT), [a], NOW_S + 10.0) == [159]
    assert idx.stats(NOW_S)["a"].speculative == 0


@pytest.mark.parametrize(
    ("events_seen", "dispatch_at_s", "lookup_at_s", "alive"),
    [
        pytest.param(False, None, NOW_S, False, id="never-published"),
        pytest.param(True, None, NOW_S + 1000, True, id="idle-engine-stays-alive"),
        pytest.param(True, NOW_S, NOW_S + 5, True, id="event-not-due-yet"),
        pytest.param(True, NOW_S, NOW_S + 11, False, id="dispatch-unanswered-past-timeout"),
    ],
)
def test_alive(events_seen: bool, dispatch_at_s: float | None, lookup_at_s: float, alive: bool) -> None:
    idx = index(events_timeout_s=10.0)
    a = endpoint("a", engine="vllm")
    if events_seen:
        idx.apply("a", batch())
    if dispatch_at_s is not None:
        idx.record(prompt(PROMPT), a, dispatch_at_s)
    assert idx.alive("a", lookup_at_s) is alive
    assert (idx.lookup(prompt(PROMPT), [a], lookup_at_s)[0] is None) is not alive


def test_events_resume_after_timeout() -> None:
    idx = index(events_timeout_s=10.0)
    a = endpoint("a", engine="vllm")
    idx.apply("a", batch())
    idx.record(prompt(PROMPT), a, NOW_S)
    assert not idx.alive("a", NOW_S + 20)
    idx.apply("a", batch(stored(PROMPT), at_s=NOW_S + 21))
    assert idx.lookup(prompt(PROMPT), [a], NOW_S + 21) == [159]


@pytest.mark.parametrize(
    ("reason", "alive_right_after"),
    [
        pytest.param(RESET_GAP, False, id="gap-distrusted-for-resync"),
        pytest.param(RESET_RESTART, True, id="restart-cache-empty-but-known"),
    ],
)
def test_reset(reason: str, alive_right_after: bool) -> None:
    idx = index(resync_s=30.0)
    a = endpoint("a", engine="vllm")
    idx.apply("a", batch(stored(PROMPT)))
    idx.reset("a", reason, NOW_S)
    assert idx.alive("a", NOW_S + 1) is alive_right_after
    assert idx.lookup(prompt(PROMPT), [a], NOW_S + 31) == [0]


def test_supervisor_restart_clears_blocks() -> None:
    idx = index()
    a = endpoint("a", engine="vllm")
    idx.apply("a", batch(stored(PROMPT)))
    assert idx.lookup(prompt(PROMPT), [a], NOW_S) == [159]
    a.restarts += 1
    assert idx.lookup(prompt(PROMPT), [a], NOW_S) == [0]


def test_block_size_from_events_beats_stats() -> None:
    idx = index()
    a = endpoint("a", engine="vllm", block_size=16)
    idx.apply("a", batch(stored(PROMPT, block=32)))
    assert idx.block_tokens(a) == 32
    assert idx.lookup(prompt(PROMPT), [a], NOW_S) == [159]


def test_without_token_ids_precise_has_no_answer() -> None:
    idx = index()
    a = endpoint("a", engine="vllm")
    idx.apply("a", batch(stored(PROMPT)))
    assert idx.lookup(prompt(None), [a], NOW_S) == [None]


def test_tracked_blocks_bounded_per_endpoint() -> None:
    idx = index(max_blocks_per_endpoint=50)
    for i in range(20):
        idx.apply("a", batch(stored(token_ids(160, start=i + 1))))
    assert idx.stats(NOW_S)["a"].blocks == 2 * 50  # engine-hash and token keys of the 50 newest blocks
    recent, old = token_ids(160, start=20), token_ids(160, start=1)
    a = endpoint("a", engine="vllm")
    assert idx.lookup(prompt(recent), [a], NOW_S) == [159]
    assert idx.lookup(prompt(old), [a], NOW_S) == [0]


@pytest.mark.parametrize(
    ("extra", "salt"),
    [
        pytest.param(None, None, id="none"),
        pytest.param(("s",), "s", id="bare-string"),
        pytest.param([["cache_salt", "s"]], "s", id="tagged-pair"),
        pytest.param([("mm", "h", 0)], None, id="other-keys"),
    ],
)
def test_salt_from_extra_keys(extra: object, salt: str | None) -> None:
    assert salt_from_extra_keys(extra) == salt


@pytest.mark.parametrize(
    ("extra", "salt"),
    [
        pytest.param(["sql-lora", "s"], "s", id="adapter-then-salt"),
        pytest.param(["sql-lora"], None, id="adapter-only"),
        pytest.param(["s"], "s", id="salt-only"),
    ],
)
def test_salt_from_extra_keys_skips_the_adapter_vllm_puts_first(extra: object, salt: str | None) -> None:
    """vLLM 0.32's events for a request for an adapter: block 0's extra keys are [lora_name, cache_salt]."""
    assert salt_from_extra_keys(extra, "sql-lora") == salt


@pytest.mark.parametrize("salt", [None, "tenant-1"])
def test_token_keys_match_an_adapters_blocks_as_vllm_publishes_them(salt: str | None) -> None:
    """vLLM names the adapter in `lora_name` and first in every block's extra keys; the request for that
    adapter (same salt) matches, the base model and another adapter do not."""
    blocks = len(PROMPT) // 16
    extra = [("sql-lora", salt) if salt else ("sql-lora",)] + [("sql-lora",)] * (blocks - 1)
    event = BlockStored(
        block_hashes=list(range(1, blocks + 1)), parent_block_hash=None, token_ids=PROMPT, block_size=16,
        medium="GPU", lora_name="sql-lora", extra_keys=extra,
    )  # fmt: skip
    idx = index()
    a = endpoint("a", engine="vllm")
    idx.apply("a", batch(event))

    def cached(lora: str | None) -> int | None:
        return idx.lookup(HashedPrompt(facts(PROMPT, cache_salt=salt), lora=lora), [a], NOW_S)[0]

    assert (cached("sql-lora"), cached(None), cached("chat-lora")) == (159, 0, 0)


def test_forget() -> None:
    idx = index()
    a = endpoint("a", engine="vllm")
    idx.apply("a", batch(stored(PROMPT)))
    idx.retain([])
    assert idx.entries() == 0 and idx.lookup(prompt(PROMPT), [a], NOW_S) == [None]
