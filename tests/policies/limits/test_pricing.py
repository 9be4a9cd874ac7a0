"""Price tables: cache reads, cache writes (both lifetimes), reasoning and long-context tiers, and a
reservation priced by the same rules as the settlement that never assumes the cheap tier."""

from __future__ import annotations

import pytest

from policies.limits.plan import Price, price_of
from policies.policy import Policy, cache_saving_usd, price_usd, usage_cost_usd
from policies.schema import ModelConfig, PoliciesConfig
from policies.types import Principal, Usage

M = 1e-6
# Claude Sonnet 4.5's published table (USD per million tokens; docs/providers.md cites it)
SONNET = {
    "input_per_mtok": 3.0,
    "cached_input_per_mtok": 0.30,
    "cache_write_per_mtok": 3.75,
    "cache_write_1h_per_mtok": 6.0,
    "output_per_mtok": 15.0,
    "long_context": {
        "above_prompt_tokens": 200_000,
        "input_per_mtok": 6.0,
        "cached_input_per_mtok": 0.60,
        "cache_write_per_mtok": 7.50,
        "cache_write_1h_per_mtok": 12.0,
        "output_per_mtok": 22.50,
    },
}


def sonnet() -> Price:
    return price_of(ModelConfig.model_validate({"price": SONNET}))


def test_each_prompt_part_is_billed_at_its_own_rate() -> None:
    price = sonnet()
    # 1000 prompt tokens: 600 read, 200 written (5 min), 100 written (1 h), 100 plain; 50 output
    cost = price.cost_usd(1000, 600, 50, cache_write_tokens=200, cache_write_1h_tokens=100)
    assert cost == pytest.approx(100 * 3.0 * M + 600 * 0.30 * M + 200 * 3.75 * M + 100 * 6.0 * M + 50 * 15.0 * M)


def test_unset_rates_default_to_the_plain_ones() -> None:
    price = price_of(ModelConfig.model_validate({"price": {"input_per_mtok": 2.0, "output_per_mtok": 8.0}}))
    assert price.cost_usd(100, 40, 10, cache_write_tokens=30, reasoning_tokens=5) == pytest.approx(
        100 * 2.0 * M + 10 * 8.0 * M
    )
    write_only = price_of(ModelConfig.model_validate({"price": {"input_per_mtok": 1.0, "cache_write_per_mtok": 1.25}}))
    assert write_only.cost_usd(10, 0, 0, cache_write_1h_tokens=10) == pytest.approx(10 * 1.25 * M)


def test_reasoning_tokens_are_part_of_the_output_at_their_rate() -> None:
    price = price_of(
        ModelConfig.model_validate({"price": {"output_per_mtok": 10.0, "reasoning_per_mtok": 3.5, "input_per_mtok": 1}})
    )
    assert price.cost_usd(0, 0, 100, reasoning_tokens=40) == pytest.approx(60 * 10.0 * M + 40 * 3.5 * M)
    assert price.cost_usd(0, 0, 10, reasoning_tokens=400) == pytest.approx(10 * 3.5 * M)  # clamped to the output


def test_parts_beyond_the_totals_are_clamped() -> None:
    price = sonnet()
    assert price.cost_usd(100, 80, 0, cache_write_tokens=80) == pytest.approx(80 * 0.30 * M + 20 * 3.75 * M)


def test_a_long_prompt_pays_the_long_context_table_for_the_whole_request() -> None:
    price = sonnet()
    short = price.cost_usd(200_000, 0, 1000)
    long = price.cost_usd(200_001, 100_000, 1000)
    assert short == pytest.approx(200_000 * 3.0 * M + 1000 * 15.0 * M)  # at the threshold: the base table
    assert long == pytest.approx(100_001 * 6.0 * M + 100_000 * 0.60 * M + 1000 * 22.50 * M)


@pytest.mark.parametrize("prompt", [10, 150_000, 199_999, 200_000, 200_001, 900_000])
def test_the_reservation_covers_every_settlement_of_the_same_prompt_and_output(prompt: int) -> None:
    price = sonnet()
    output = 4096
    reserved = price.reserve_usd(prompt, output)
    worst = max(
        price.cost_usd(prompt, 0, output),
        price.cost_usd(prompt, 0, output, cache_write_tokens=prompt),
        price.cost_usd(prompt, 0, output, cache_write_1h_tokens=prompt),
        price.cost_usd(prompt, prompt, output),
    )
    assert reserved >= worst - 1e-12
    # and it is the tier the settlement uses, not the cheap one
    assert reserved == pytest.approx(prompt * price.tier(prompt).write_1h_usd + output * price.tier(prompt).output_usd)


def test_the_reservation_assumes_the_dearer_of_output_and_reasoning() -> None:
    price = Price(1 * M, 1 * M, 2 * M, reasoning_usd=5 * M)
    assert price.reserve_usd(0, 100) == pytest.approx(500 * M)
    assert price.cost_usd(0, 0, 100, reasoning_tokens=100) <= price.reserve_usd(0, 100)


def test_cost_usd_keeps_its_three_positional_arguments() -> None:
    """Callers (the cost header, budgets) call it with prompt, cached, completion only."""
    assert Price(1.0, 0.5, 2.0).cost_usd(10, 4, 3) == pytest.approx(6 * 1.0 + 4 * 0.5 + 3 * 2.0)


def test_policy_prices_usage_with_writes_and_reports_the_saving() -> None:
    policy = Policy(PoliciesConfig.model_validate({"models": {"claude": {"price": SONNET}}}))
    read = Usage(prompt_tokens=2000, completion_tokens=10, cached_tokens=1800)
    cost = price_usd(policy, "claude", read)
    assert cost == pytest.approx(200 * 3.0 * M + 1800 * 0.30 * M + 10 * 15.0 * M)
    assert cache_saving_usd(policy, "claude", read, cost) == pytest.approx(1800 * (3.0 - 0.30) * M)
    write = Usage(prompt_tokens=2000, completion_tokens=10, cache_write_tokens=1800)
    cost = price_usd(policy, "claude", write)
    assert cache_saving_usd(policy, "claude", write, cost) == pytest.approx(-1800 * (3.75 - 3.0) * M)


def test_chat_usage_carries_cache_writes_and_reasoning() -> None:
    usage = Usage.from_chat(
        {
            "prompt_tokens": 100,
            "completion_tokens": 20,
            "prompt_tokens_details": {"cached_tokens": 30, "cache_write_tokens": 40, "cache_write_1h_tokens": 5},
            "completion_tokens_details": {"reasoning_tokens": 7},
        }
    )
    assert usage == Usage(100, 20, 30, 40, 5, 7)
    assert Usage.from_chat({"prompt_tokens": 3}) == Usage(3, 0, 0)
    assert Usage.from_chat([1]) is None


@pytest.mark.parametrize(
    ("value", "read"),
    [(-5, 0), (2.7, 2), (float("nan"), 0), (float("inf"), 0), ("12", 12), ("x", 0), ("9" * 5000, 0), (None, 0),
     (True, 0), ([3], 0), ("\u00b2", 0)],
)  # fmt: skip
def test_usage_an_upstream_got_wrong_bills_nothing_negative_and_never_raises(value: object, read: int) -> None:
    """Billing reads an answer's usage as non-negative integers: a negative count would refund a
    budget, and a count that is not a number would fail the settlement."""
    fields = ("prompt_tokens", "completion_tokens")
    details = {"cached_tokens": value, "cache_write_tokens": value, "cache_write_1h_tokens": value}
    usage = Usage.from_chat(
        {**dict.fromkeys(fields, value), "prompt_tokens_details": details,
         "completion_tokens_details": {"reasoning_tokens": value}}
    )  # fmt: skip
    assert usage == Usage(read, read, read, read, read, read)


def test_a_long_context_table_needs_its_threshold() -> None:
    with pytest.raises(ValueError, match="above_prompt_tokens"):
        ModelConfig.model_validate({"price": {"long_context": {"input_per_mtok": 6.0}}})


# A model served by an owned pool at its own price and by two hosted pools with dearer tables: one
# dearer per token, one with a long-context tier and dear cache writes.
POOLED = {
    "price": {"input_per_mtok": 1.0, "output_per_mtok": 2.0},
    "pool_prices": {
        "hosted-a": {"input_per_mtok": 3.0, "cached_input_per_mtok": 0.3, "output_per_mtok": 15.0},
        "hosted-b": SONNET,
    },
}


def pooled_policy() -> Policy:
    return Policy(PoliciesConfig.model_validate({"models": {"chat": POOLED}}))


def test_a_pool_with_its_own_price_bills_at_it_and_the_others_at_the_models() -> None:
    policy = pooled_policy()
    usage = Usage(prompt_tokens=1000, completion_tokens=100, cached_tokens=400)
    assert price_usd(policy, "chat", usage) == pytest.approx(1000 * 1.0 * M + 100 * 2.0 * M)
    assert price_usd(policy, "chat", usage, pool="owned") == price_usd(policy, "chat", usage)
    assert price_usd(policy, "chat", usage, pool="hosted-a") == pytest.approx(
        600 * 3.0 * M + 400 * 0.3 * M + 100 * 15.0 * M
    )
    assert cache_saving_usd(policy, "chat", usage, 0.0, pool="hosted-a") == pytest.approx(1000 * 3.0 * M + 100 * 15 * M)
    assert policy.price("other-model", "hosted-a") == Price()  # a pool's price is per model


@pytest.mark.parametrize("prompt", [10, 4000, 199_999, 200_001, 900_000])
@pytest.mark.parametrize("output", [1, 4096])
def test_the_reservation_before_routing_covers_the_settlement_at_every_pool(prompt: int, output: int) -> None:
    """The reservation is made before routing: at the dearest pool's reservation, so whichever pool
    serves, its settlement of the same prompt and output (any mix of reads, writes, reasoning) fits."""
    policy = pooled_policy()
    plan = policy.admission_plan(_anyone(), "chat")
    reserved = plan.reserve_usd(prompt, output)
    for pool in (None, "owned", "hosted-a", "hosted-b"):
        price = plan.price_at(pool)
        assert price == policy.price("chat", pool)
        for usage in (
            Usage(prompt, output),
            Usage(prompt, output, cached_tokens=prompt),
            Usage(prompt, output, cache_write_tokens=prompt),
            Usage(prompt, output, cache_write_1h_tokens=prompt),
            Usage(prompt, output, reasoning_tokens=output),
        ):
            assert usage_cost_usd(price, usage) <= reserved + 1e-12, (pool, usage)
    # and it is the dearest pool's reservation, not a sum or a guess
    assert reserved == pytest.approx(
        max(plan.price_at(p).reserve_usd(prompt, output) for p in ("hosted-a", "hosted-b", None))
    )


def test_a_model_without_pool_prices_reserves_at_its_own_price() -> None:
    policy = Policy(PoliciesConfig.model_validate({"models": {"chat": {"price": SONNET}}}))
    plan = policy.admission_plan(_anyone(), "chat")
    assert plan.pool_prices == ()
    assert plan.reserve_usd(1000, 100) == sonnet().reserve_usd(1000, 100)
    assert plan.price_at("any-pool") == plan.price


def test_a_pool_price_takes_no_batch_factor() -> None:
    with pytest.raises(ValueError, match="batch_factor"):
        ModelConfig.model_validate({"pool_prices": {"p": {"input_per_mtok": 1.0, "batch_factor": 0.5}}})


def _anyone() -> Principal:
    return Principal(key_id="k", tenant="t", allowed_models=None, priority=0)
