"""Deterministic pseudo-text: what the simulated model "says", and how long it talks.

Output is a sequence of English words, each exactly one cl100k_base token, so that ``encode(text)``
gives back the generated ids: a client that appends the answer to the conversation sends the very
ids the engine cached, and the next turn hits the prefix cache through the previous answer as it
would on a real engine. The same prompt and seed give the same answer and the same length (think
greedy decoding).
"""

from __future__ import annotations

import functools
import math
import random
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import orjson
import xxhash

from backends.tokenization import encode

_WORDS_TEXT = (
    "the of and to in is that for it as with was on be by this are at from or have an they which "
    "one you were all we when there can more if no out so said what up its about into than them "
    "only other new some time could these two may then first any like now my such make over our "
    "even most me state after also made many did must before back see through way where get much "
    "go well your know should down work year because come people just long each those how take "
    "good great three own small right large last little still world life here both between while "
    "part under never day same another know high every found old place system given model data "
    "cache token engine request value result number point group order line between house light "
    "water power city river field music story paper table window garden market letter question"
)
_WORDS = _WORDS_TEXT.split(" ")


@dataclass(frozen=True, slots=True)
class _Vocabulary:
    lower_ids: tuple[int, ...]  # " word" continuing a sentence
    upper_ids: tuple[int, ...]  # " Word" after a full stop
    first_ids: tuple[int, ...]  # "Word" opening the answer
    period_id: int
    text_by_id: dict[int, str]


def _single_token(text: str) -> int | None:
    ids = encode(text)
    return ids[0] if len(ids) == 1 else None


@functools.cache
def vocabulary() -> _Vocabulary:
    """Words whose spaced, capitalised and bare forms are each one token (checked, not assumed)."""
    lower: list[int] = []
    upper: list[int] = []
    first: list[int] = []
    text_by_id: dict[int, str] = {}
    for word in dict.fromkeys(_WORDS):
        forms = (f" {word}", f" {word.capitalize()}", word.capitalize())
        ids = [_single_token(form) for form in forms]
        if any(i is None for i in ids):
            continue
        for form, token_id in zip(forms, ids, strict=True):
            assert token_id is not None
            text_by_id[token_id] = form
        lower.append(ids[0])  # type: ignore[arg-type]
        upper.append(ids[1])  # type: ignore[arg-type]
        first.append(ids[2])  # type: ignore[arg-type]
    period = _single_token(".")
    assert period is not None
    text_by_id[period] = "."
    return _Vocabulary(tuple(lower), tuple(upper), tuple(first), period, text_by_id)


def request_rng(prompt_ids: Sequence[int], seed: int) -> random.Random:
    """A generator seeded by the prompt's ids and the engine seed (same prompt, same answer)."""
    digest = xxhash.xxh3_64_intdigest(array("I", prompt_ids).tobytes(), seed=seed & (2**64 - 1))
    return random.Random(digest)


def natural_length(rng: random.Random, mean_tokens: float) -> int:
    """Where the model would stop on its own: log-normal (sigma 0.8) with the given mean, >= 1.

    Output lengths of chat traffic are right-skewed (Azure LLM trace 2023, conversation: mean 211,
    median 129); a log-normal with sigma 0.8 has median/mean = 0.73, close to that shape.
    """
    sigma = 0.8
    mu = math.log(max(mean_tokens, 1.0)) - sigma * sigma / 2
    return max(1, round(rng.lognormvariate(mu, sigma)))


def generate_ids(rng: random.Random, count: int) -> list[int]:
    """`count` token ids of sentences: words, and a full stop every 6-20 words.

    The same draws as ``rng.choice`` and ``rng.randint(6, 20)`` (`_below` is Random._randbelow),
    made without their two Python calls per token.
    """
    vocab = vocabulary()
    if count <= 0:
        return []
    getrandbits = rng.getrandbits

    def _below(n: int) -> int:
        k = n.bit_length()
        r = getrandbits(k)
        while r >= n:
            r = getrandbits(k)
        return r

    lower, upper, period = vocab.lower_ids, vocab.upper_ids, vocab.period_id
    n_lower, n_upper = len(lower), len(upper)
    k_lower = n_lower.bit_length()
    ids = [vocab.first_ids[_below(len(vocab.first_ids))]]
    append = ids.append
    next_stop = 6 + _below(15)
    after_stop = False
    remaining = count - 1
    while remaining > 0:
        remaining -= 1
        if next_stop == 0:
            append(period)
            next_stop = 6 + _below(15)
            after_stop = True
            continue
        if after_stop:
            append(upper[_below(n_upper)])
            after_stop = False
        else:
            r = getrandbits(k_lower)  # _below(n_lower), inlined for the common case
            while r >= n_lower:
                r = getrandbits(k_lower)
            append(lower[r])
        next_stop -= 1
    return ids


def render(ids: Sequence[int]) -> str:
    """Text of generated ids (a table lookup: no tokenizer call per chunk)."""
    table = vocabulary().text_by_id
    return "".join(table[i] for i in ids)


@functools.cache
def json_text() -> dict[int, bytes]:
    """Each vocabulary id's text JSON-escaped, as UTF-8 (what goes between the quotes of a chunk)."""
    return {token_id: orjson.dumps(text)[1:-1] for token_id, text in vocabulary().text_by_id.items()}
