"""A simulated engine that is tokenizing a long prompt still answers /health and /metrics (it tokenizes
long prompts off its event loop, as vLLM's API server does): a gateway must never take a busy engine
for a dead one. Real processes over real sockets; the assertion counts answers, never times them."""

from __future__ import annotations

import http.client
import random
import threading
from collections.abc import Callable

import orjson

from tests.support.procs import SimEngines, http_get

WORDS = 700_000  # about 4.5 MB of text, 2M tokens: a second or more of tokenizing on this machine


def long_prompt() -> str:
    rng = random.Random(7)
    letters = "abcdefghijklmnopqrstuvwxyz"
    vocabulary = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(5000)]
    return " ".join(rng.choice(vocabulary) for _ in range(WORDS))


def test_health_and_metrics_answer_while_a_long_prompt_is_tokenized(sim_factory: Callable[..., SimEngines]) -> None:
    engines = sim_factory(count=1)
    body = orjson.dumps({"prompt": long_prompt(), "max_tokens": 1})
    done = threading.Event()
    status: list[int] = []

    def send() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", engines.ports[0], timeout=300)
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        status.append(conn.getresponse().status)  # 400: longer than the context, found once tokenized
        conn.close()
        done.set()

    sender = threading.Thread(target=send)
    sender.start()
    answered = 0
    while not done.is_set():
        health, _ = http_get(engines.urls[0] + "/health", timeout_s=30)
        metrics, _ = http_get(engines.urls[0] + "/metrics", timeout_s=30)
        if not done.is_set() and health == 200 and metrics == 200:
            answered += 1
    sender.join()
    assert status == [400]
    assert answered >= 5  # on the loop, tokenizing would have held every one of them until the end
