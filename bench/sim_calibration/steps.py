"""python -m bench.sim_calibration.steps [--venv PATH]: the real vLLM's step composition vs the simulator's.

Runs the CPU build of vLLM (the venv `make vllm-venv` builds; `--venv` or $TOKENWAY_VLLM_VENV) on a
tiny random-weight Llama with a small token budget, records the tokens each engine step schedules
for each request (`vllm_step_probe.py`), runs the same requests through `sim`'s scheduler,
and writes bench/results/sim-steps.md with both side by side. The durations differ (a CPU and a
simulated GPU); what must agree is the order and size of the steps under chunked prefill: which
request gets how many tokens in which step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from sim.kv_cache import KVCacheManager
from sim.scheduler import Request, Scheduler

REPO = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).with_name("vllm_step_probe.py")
BUDGET, MAX_SEQS = 64, 4
CASES: tuple[dict[str, Any], ...] = (
    {"name": "one long prompt ahead of two shorter ones", "prompts": [200, 100, 30], "outputs": 5},
    {"name": "more requests than batch slots", "prompts": [40, 20, 90, 10, 60, 30], "outputs": 3},
    {"name": "prompts that fit a step together", "prompts": [10, 12, 14, 16], "outputs": 4},
)
MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 2048,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
}

Steps = list[dict[str, int]]


def simulated_steps(prompts: list[int], outputs: int) -> Steps:
    """The same requests through the simulator's scheduler (prefix caching off, as in the probe)."""
    scheduler = Scheduler(KVCacheManager(4096, 32, enable_caching=False), MAX_SEQS, BUDGET)
    requests = [
        Request(str(i), [(7 * i + j) % 2000 + 2 for j in range(n)], [0] * outputs, "length", 0.0, outputs)
        for i, n in enumerate(prompts)
    ]
    for req in requests:
        scheduler.add(req)
    steps: Steps = []
    while not all(req.finished for req in requests):
        step = scheduler.schedule(float(len(steps)))
        scheduled = {req.request_id: n for req, n, _ in step.prefills}
        scheduled.update({req.request_id: 1 for req, _ in step.decodes})
        steps.append(scheduled)
        scheduler.complete_step(step, float(len(steps)))
    return steps


def real_steps(venv: Path) -> list[Steps]:
    with tempfile.TemporaryDirectory(prefix="tokenway-steps-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(MODEL_CONFIG))
        spec = {"model": tmp, "budget": BUDGET, "max_seqs": MAX_SEQS, "cases": list(CASES)}
        env = {
            **os.environ,
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core (and its scheduler) in the probe
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_NUM_THREADS": "1",
        }
        done = subprocess.run(
            # -I: the probe's own folder stays off sys.path (its kernels.py would shadow a package)
            [str(venv / "bin" / "python"), "-I", str(PROBE), json.dumps(spec)],
            capture_output=True,
            text=True,
            env=env,
            timeout=1200,
            check=False,
        )
    for line in done.stdout.splitlines():
        if line.startswith("STEPS "):
            result: list[Steps] = json.loads(line.removeprefix("STEPS "))
            return result
    raise RuntimeError(f"the probe printed no steps (exit {done.returncode}):\n{done.stderr[-3000:]}")


def _cell(step: dict[str, int]) -> str:
    return ", ".join(f"r{k}:{v}" for k, v in sorted(step.items(), key=lambda kv: int(kv[0])))


def write(real: list[Steps], simulated: list[Steps], version: str, out: Path) -> bool:
    lines = [
        "# Step composition: the real vLLM vs the simulated engine",
        "",
        f"The CPU build of vLLM {version} (`make vllm-venv`) and `sim`'s scheduler, given the same",
        f"requests at once, with a token budget of {BUDGET} per step and {MAX_SEQS} batch slots, prefix caching",
        "off. Each cell lists what one step schedules: `rN:k` is k tokens of request N (a prompt chunk, or 1",
        "for a decode). Reproduce with `python -m bench.sim_calibration.steps --venv PATH`.",
        "",
    ]
    identical = True
    for case, r, s in zip(CASES, real, simulated, strict=True):
        same = r == s
        identical &= same
        lines += [
            f"## {case['name']}: prompts {case['prompts']}, {case['outputs']} output tokens each",
            "",
            f"{len(r)} real steps, {len(s)} simulated; {'identical' if same else '**different**'}.",
            "",
            "| step | real vLLM | simulated |",
            "| ---: | --- | --- |",
        ]
        for i in range(max(len(r), len(s))):
            real_cell = _cell(r[i]) if i < len(r) else ""
            sim_cell = _cell(s[i]) if i < len(s) else ""
            lines.append(f"| {i + 1} | {real_cell} | {sim_cell}{'' if real_cell == sim_cell else ' (differs)'} |")
        lines.append("")
    out.write_text("\n".join(lines))
    return identical


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sim_calibration.steps")
    parser.add_argument("--venv", type=Path, default=os.environ.get("TOKENWAY_VLLM_VENV"))
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "sim-steps.md")
    args = parser.parse_args(argv)
    if args.venv is None or not (Path(args.venv) / "bin" / "python").exists():
        print("needs the real vLLM venv: --venv PATH or $TOKENWAY_VLLM_VENV (make vllm-venv)", file=sys.stderr)
        return 2
    venv = Path(args.venv)
    version = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import importlib.metadata as m; print(m.version('vllm'))"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    real = real_steps(venv)
    simulated = [simulated_steps(case["prompts"], case["outputs"]) for case in CASES]
    identical = write(real, simulated, version, args.out)
    print(f"wrote {args.out.relative_to(REPO)}: {'identical' if identical else 'DIFFERENT'} step composition")
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
