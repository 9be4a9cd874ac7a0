"""What the simulated model "embeds": deterministic unit vectors hashed from the token ids.

Feature hashing over the bag of tokens: every token adds +1 or -1 to `HASHES_PER_TOKEN` coordinates
picked by a 64-bit mix (splitmix64) of its id and the engine seed; the sum is scaled to unit length.
The same ids give the same vector (any dimension), texts that share tokens point in similar
directions (cosine ~ overlap), unrelated texts are near orthogonal. float32, as vLLM returns them.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

HASHES_PER_TOKEN = 4
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    x = x ^ (x >> np.uint64(30))
    x = x * _MIX1
    x = x ^ (x >> np.uint64(27))
    x = x * _MIX2
    return x ^ (x >> np.uint64(31))


def embed(token_ids: Sequence[int], dimensions: int, seed: int = 0) -> npt.NDArray[np.float32]:
    """The unit vector (float32, `dimensions` long) of one input's token ids."""
    if dimensions < 1:
        raise ValueError("dimensions must be >= 1")
    ids = np.asarray(token_ids, dtype=np.uint64).reshape(-1, 1)
    salts = (
        np.arange(1, HASHES_PER_TOKEN + 1, dtype=np.uint64)
        + np.uint64(seed & (2**32 - 1)) * np.uint64(HASHES_PER_TOKEN + 1)
    ) * _GOLDEN
    hashed = _splitmix64(ids * _MIX2 + salts).ravel()  # wraps mod 2**64, as intended
    index = (hashed >> np.uint64(1)) % np.uint64(dimensions)
    sign = 1.0 - 2.0 * (hashed & np.uint64(1)).astype(np.float64)
    vector = np.bincount(index.astype(np.intp), weights=sign, minlength=dimensions)
    norm = float(np.linalg.norm(vector))
    if norm == 0.0:  # no tokens, or every contribution cancelled: a fixed axis of the seed
        vector[int(seed) % dimensions] = 1.0
        norm = 1.0
    result: npt.NDArray[np.float32] = (vector / norm).astype(np.float32)
    return result


def encode_base64(vector: npt.NDArray[np.float32]) -> str:
    """OpenAI's `encoding_format: "base64"`: the float32 little-endian bytes, base64."""
    return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
