"""One worker's decode step, in-process, under each of the CPU speed-ups of issue 10.

    .venv/bin/python -m bench.decode_step              # the whole table (a few minutes)
    .venv/bin/python -m bench.decode_step --steps 10 --configs fp32-all,bf16-all

A ModelRunner on the W64 model prefills 64 requests x 128 prompt tokens, then times
decode steps with all 64 running (contexts ~130-160 tokens). Each configuration runs in a
fresh process (its own thread pools and oneDNN caches), in the order listed, so every row
is the previous one plus one change; the ratio column is over the first row of the dtype.
Writes bench/results/decode_step.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

from bench.common import REPO_ROOT, write_results, write_w64_model

# name -> (dtype, attention backend, --cpu-linear, native kernels, description)
CONFIGS = {
    "fp32-baseline": (
        "float32",
        "torch",
        "torch",
        "0",
        "reference attention, F.linear (MKL): before issue 10",
    ),
    "fp32-onednn": ("float32", "torch", "onednn", "0", "+ oneDNN-packed linear weights"),
    "fp32-cpu-attention": (
        "float32",
        "cpu",
        "onednn",
        "0",
        "+ CPU attention backend (gather + SDPA)",
    ),
    "fp32-all": ("float32", "cpu", "onednn", "1", "+ C decode kernel (no gather)"),
    "bf16-torch-linear": ("bfloat16", "cpu", "torch", "1", "bf16, F.linear"),
    "bf16-sdpa": ("bfloat16", "cpu", "onednn", "0", "bf16, oneDNN, gather + SDPA"),
    "bf16-all": ("bfloat16", "cpu", "onednn", "1", "bf16, oneDNN, C decode kernel"),
}
NUM_REQUESTS, PROMPT_LEN = 64, 128


def measure(config: str, steps: int) -> dict:
    """Decode ms/step of one configuration (run in this process)."""
    import torch

    from protos.step import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
    from worker_svc.runner import ModelRunner
    from worker_svc.runner_config import RunnerConfig

    dtype, attention, linear, _, _ = CONFIGS[config]
    model = str(write_w64_model(REPO_ROOT / ".cache" / "w64-llama"))
    blocks_per_request = (PROMPT_LEN + steps + 16) // 16 + 1
    runner = ModelRunner.from_config(
        RunnerConfig(
            model_path=model,
            dtype=dtype,
            attention_backend=attention,
            cpu_linear=linear,
            num_blocks=NUM_REQUESTS * blocks_per_request + 8,
        )
    )
    rng = random.Random(0)
    sampled, computed = {}, {}
    for first in range(0, NUM_REQUESTS, 16):
        new = [
            NewRequestData(
                f"r{i}",
                [rng.randrange(1, 32000) for _ in range(PROMPT_LEN)],
                PROMPT_LEN,
                list(range(i * blocks_per_request, (i + 1) * blocks_per_request)),
                0,
                SamplingParams(temperature=0.0, seed=i),
            )
            for i in range(first, first + 16)
        ]
        out = runner.execute_step(
            SchedulerOutput(
                step_id=first,
                new_requests=new,
                num_scheduled_tokens={r.request_id: PROMPT_LEN for r in new},
            )
        )
        sampled.update(out.sampled)
    computed = {request_id: PROMPT_LEN for request_id in sampled}
    times = []
    for step_id in range(100, 100 + steps + 3):
        start = time.perf_counter()
        out = runner.execute_step(
            SchedulerOutput(
                step_id=step_id,
                cached_requests=[
                    CachedRequestData(r, [], computed[r], [sampled[r].token_id]) for r in sampled
                ],
                num_scheduled_tokens={r: 1 for r in sampled},
            )
        )
        times.append(time.perf_counter() - start)
        for request_id in out.sampled:
            computed[request_id] += 1
        sampled = out.sampled
    times = sorted(times[3:])
    median_ms = 1000 * times[len(times) // 2]
    return {
        "config": config,
        "dtype": dtype,
        "threads": torch.get_num_threads(),
        "step_ms": median_ms,
        "tok_s": NUM_REQUESTS / median_ms * 1000,
    }


def unavailable(config: str) -> str | None:
    """Why `config` cannot run on this CPU, or None."""
    import torch

    from kernels.cpu_features import cpu_features
    from worker_svc.model.matmul import onednn_linear_available

    dtype, _, linear, _, _ = CONFIGS[config]
    if linear == "onednn" and not onednn_linear_available(getattr(torch, dtype)):
        return f"oneDNN {dtype} linear does not run on this CPU [{cpu_features().isa_summary}]"
    if dtype == "bfloat16" and cpu_features().why_bf16_is_slow():
        # W64's 8,192 prompt tokens alone would take many minutes at the emulated rate.
        return cpu_features().why_bf16_is_slow()
    return None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child process
    args = parser.parse_args()
    import torch

    if args.one:
        from kernels import cpu_native

        # The parent sets PAGEMESH_NATIVE_KERNELS per configuration: read once, here.
        cpu_native.configure(cpu_native.native_kernel_config_from_env(os.environ))
        print(json.dumps(measure(args.one, args.steps)))
        return
    rows, data, first_of = [], [], {}
    for config in args.configs.split(","):
        reason = unavailable(config)
        if reason:  # e.g. oneDNN bf16 on an AVX2-only CPU: a row that says so, no crash
            rows.append([config, CONFIGS[config][4], "—", "—", f"skipped: {reason}"])
            data.append({"config": config, "dtype": CONFIGS[config][0], "skipped": reason})
            print(rows[-1], flush=True)
            continue
        env = {**os.environ, "PAGEMESH_NATIVE_KERNELS": CONFIGS[config][3]}
        line = subprocess.run(
            [
                sys.executable,
                "-m",
                "bench.decode_step",
                "--one",
                config,
                "--steps",
                str(args.steps),
            ],
            env=env,
            cwd=REPO_ROOT,
            check=True,
            capture_output=True,
            text=True,
        ).stdout.splitlines()[-1]
        result = json.loads(line)
        data.append(result)
        base = first_of.setdefault(result["dtype"], result["step_ms"])
        rows.append(
            [
                config,
                CONFIGS[config][4],
                f"{result['step_ms']:.1f}",
                f"{result['tok_s']:,.0f}",
                f"{base / result['step_ms']:.2f}x",
            ]
        )
        print(rows[-1], flush=True)
    write_results(
        "decode_step",
        f"W64 decode step, {NUM_REQUESTS} running requests, in-process ModelRunner, "
        f"median of {args.steps} steps, {torch.get_num_threads()} threads "
        "(`python -m bench.decode_step`)",
        ["config", "what", "ms/step", "decode tok/s", "vs first of its dtype"],
        rows,
        data,
    )


if __name__ == "__main__":
    main()
