"""Multi-LoRA: what a decode step of rows over many adapters costs against the base model's.

    .venv/bin/python -m bench.lora [--steps 20] [--adapters 8] [--rank 16] [--dtype float32]

SmolLM2-135M (`.cache/smollm2-hf`, as bench.control_plane writes it) with `--adapters`
random PEFT adapters of rank `--rank` on all seven projections (q, k, v, o, gate, up, down;
`.cache/lora-smollm2/`, written once with peft). One in-process ModelRunner with LoRA on
(max_loras = the adapter count) holds two sets of 64 requests of 128 prompt tokens: one on
the base model, one whose rows are spread evenly over the adapters. Decode steps of the two
sets alternate (so drift hits both); the ratio is the mixed step's median over the base
step's (target: <= 1.3x). Writes bench/results/<name>.{md,json}.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from bench.common import REPO_ROOT, write_results
from bench.control_plane import write_smollm2_folder

NUM_REQUESTS, PROMPT_LEN = 64, 128


def write_adapters(base: Path, count: int, rank: int) -> list[Path]:
    from pagemesh.testing.tiny_lora import write_lora

    root = REPO_ROOT / ".cache" / "lora-smollm2"
    paths = []
    for i in range(count):
        path = root / f"r{rank}-{i}"
        if not (path / "adapter_config.json").exists():
            write_lora(base, path, rank=rank, alpha=2 * rank, seed=i, gain=0.01)
        paths.append(path)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--name", default="lora_step")
    args = parser.parse_args()
    import torch

    from protos.step import (CachedRequestData, LoraRef, NewRequestData, SamplingParams,
                             SchedulerOutput)
    from worker_svc.lora import LoraConfig
    from worker_svc.runner import ModelRunner, RunnerConfig

    base = write_smollm2_folder(REPO_ROOT / ".cache" / "smollm2-hf")
    adapters = [LoraRef(f"a{i}", str(p)) for i, p in
                enumerate(write_adapters(base, args.adapters, args.rank))]
    blocks = (PROMPT_LEN + args.steps + 24) // 16 + 1
    runner = ModelRunner.from_config(RunnerConfig(
        model_path=str(base), dtype=args.dtype, num_blocks=2 * NUM_REQUESTS * blocks + 8,
        lora=LoraConfig(args.adapters, args.rank, args.adapters)))
    rng = random.Random(0)
    sets = {"base": [None] * NUM_REQUESTS,
            "mixed": [adapters[i % len(adapters)] for i in range(NUM_REQUESTS)]}
    state: dict[str, tuple[dict, dict]] = {}
    step_id = 0
    for which, (name, loras) in enumerate(sets.items()):
        sampled = {}
        for first in range(0, NUM_REQUESTS, 16):
            new = [NewRequestData(f"{name}{i}", [rng.randrange(1, 49000) for _ in range(PROMPT_LEN)],
                                  PROMPT_LEN, list(range((which * NUM_REQUESTS + i) * blocks,
                                                         (which * NUM_REQUESTS + i + 1) * blocks)),
                                  0, SamplingParams(temperature=0.0, seed=i), lora=loras[i])
                   for i in range(first, first + 16)]
            out = runner.execute_step(SchedulerOutput(
                step_id=step_id, new_requests=new,
                num_scheduled_tokens={r.request_id: PROMPT_LEN for r in new}))
            step_id += 1
            sampled.update(out.sampled)
        state[name] = (sampled, {r: PROMPT_LEN for r in sampled})
    times: dict[str, list[float]] = {name: [] for name in sets}
    for _ in range(args.steps + 3):
        for name in sets:
            sampled, computed = state[name]
            start = time.perf_counter()
            out = runner.execute_step(SchedulerOutput(
                step_id=step_id,
                cached_requests=[CachedRequestData(r, [], computed[r], [sampled[r].token_id])
                                 for r in sampled],
                num_scheduled_tokens={r: 1 for r in sampled}))
            times[name].append(time.perf_counter() - start)
            step_id += 1
            for r in out.sampled:
                computed[r] += 1
            state[name] = (out.sampled, computed)
    base_ms = 1000 * statistics.median(times["base"][3:])
    mixed_ms = 1000 * statistics.median(times["mixed"][3:])
    rows = [["64 rows, base model", f"{base_ms:.1f}", ""],
            [f"64 rows over {args.adapters} rank-{args.rank} adapters", f"{mixed_ms:.1f}",
             f"{mixed_ms / base_ms:.2f}x"]]
    write_results(
        args.name,
        f"Multi-LoRA decode step: SmolLM2-135M, {args.dtype}, in-process ModelRunner, "
        f"{NUM_REQUESTS} running requests (~{PROMPT_LEN + args.steps // 2} tokens of context), "
        f"median of {args.steps} alternated steps, {torch.get_num_threads()} threads "
        "(bench/lora.py)",
        ["step", "ms/step", "vs base"], rows,
        {"base_ms": base_ms, "mixed_ms": mixed_ms, "ratio": mixed_ms / base_ms,
         "args": vars(args)})


if __name__ == "__main__":
    main()
