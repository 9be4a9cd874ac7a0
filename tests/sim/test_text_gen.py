from __future__ import annotations

from backends.tokenization import encode
from sim import text_gen


def test_generated_text_tokenizes_back_to_the_generated_ids() -> None:
    ids = text_gen.generate_ids(text_gen.request_rng([1, 2, 3], seed=0), 500)
    assert encode(text_gen.render(ids)) == ids


def test_same_prompt_same_answer_other_prompt_other_answer() -> None:
    def answer(prompt: list[int]) -> list[int]:
        return text_gen.generate_ids(text_gen.request_rng(prompt, seed=7), 50)

    assert answer([5, 6]) == answer([5, 6])
    assert answer([5, 6]) != answer([5, 7])


def test_natural_lengths_have_the_requested_mean() -> None:
    rng = text_gen.request_rng([0], seed=1)
    lengths = [text_gen.natural_length(rng, 200) for _ in range(4000)]
    assert 180 < sum(lengths) / len(lengths) < 220
    assert min(lengths) >= 1
