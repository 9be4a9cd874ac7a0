"""Run under the real vLLM's own interpreter (not the project's): record what each engine step schedules.

    VLLM_TARGET_DEVICE=cpu VLLM_ENABLE_V1_MULTIPROCESSING=0 $VENV/bin/python vllm_step_probe.py SPEC_JSON

SPEC_JSON: {"model": dir, "budget": int, "max_seqs": int, "cases": [{"prompts": [len, ...], "outputs": n}]}.
Prints one line `STEPS <json>`: per case, the list of steps, each {request index: tokens scheduled}.
The engine core runs in this process, so its V1 scheduler is wrapped directly; prompts are token ids
(no tokenizer) and the model has random weights (`load_format="dummy"`). Imports only vLLM.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.v1.core.sched.scheduler import Scheduler

_steps: list[dict[str, int]] = []
_schedule = Scheduler.schedule


def _recording_schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
    out = _schedule(self, *args, **kwargs)
    if out.num_scheduled_tokens:
        _steps.append(dict(out.num_scheduled_tokens))
    return out


def main() -> None:
    spec = json.loads(sys.argv[1])
    Scheduler.schedule = _recording_schedule
    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        load_format="dummy",
        enforce_eager=True,
        max_num_batched_tokens=spec["budget"],
        max_num_seqs=spec["max_seqs"],
        max_model_len=2048,
        block_size=32,
        enable_prefix_caching=False,
        seed=0,
    )
    results = []
    for case in spec["cases"]:
        _steps.clear()
        prompts = [
            TokensPrompt(prompt_token_ids=[(7 * i + j) % 2000 + 2 for j in range(n)])
            for i, n in enumerate(case["prompts"])
        ]
        llm.generate(
            prompts, SamplingParams(max_tokens=case["outputs"], ignore_eos=True, detokenize=False), use_tqdm=False
        )
        # request ids are "<index>-<suffix>" in submission order within one generate call
        order = sorted({rid for step in _steps for rid in step}, key=lambda rid: int(rid.split("-")[0]))
        index = {rid: i for i, rid in enumerate(order)}
        results.append([{str(index[rid]): n for rid, n in step.items()} for step in _steps])
    print("STEPS " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
