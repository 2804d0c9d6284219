"""Run by bench/gpu_check.sh on a CUDA machine: tp=1 and (with 2 GPUs) tp=2 over NCCL,
bf16, the same greedy tokens in both, output tokens/s with 1 and 16 concurrent requests, and
JSON-schema requests (the token masks applied on the GPU by the torch path) validating.
Decode steps replay CUDA graphs by default (worker_svc/cuda_graphs.py); tp=1 runs again with
--enforce-eager: the same greedy tokens, and what the graphs save per token (ITL)."""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path

import torch

from bench.common import REPO_ROOT, run_mesh, write_results, write_w64_model
from pagemesh.tools.mesh_process import Mesh, greedy_request
from protos.pagemesh.v1 import generate_pb2


def main() -> None:
    model = str(write_w64_model(REPO_ROOT / ".cache" / "w64-llama"))
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 32000) for _ in range(128)] for _ in range(16)]
    layouts: list[tuple[int, bool]] = [(1, False), (1, True)]
    if torch.cuda.device_count() >= 2:
        layouts.append((2, False))
    rows, tokens, sizing, structured = [], {}, {}, {}
    for tp, eager in layouts:
        name = f"tp{tp}{'-eager' if eager else ''}"
        mesh = Mesh(
            model,
            Path(tempfile.mkdtemp()) / f"{name}.log",
            cluster=f"gpu-{name}",
            extra_args=["--device", "cuda", "--dtype", "bfloat16", "--tp", str(tp)]
            + (["--enforce-eager"] if eager else []),
        ).wait_ready()
        try:
            tokens[name] = [mesh.generate(greedy_request(p, 32)).token_ids for p in prompts[:4]]
            structured[name] = constrained_valid(mesh, prompts[:4])
            # The KV cache sized from the GPU (profiled peak, --gpu-memory-utilization 0.9).
            sizing[name] = mesh.stub.GetModelInfo(
                generate_pb2.GetModelInfoRequest()
            ).kv_cache_sizing
            for concurrency in (1, 16):
                engine = f"pagemesh tp={tp} cuda bf16 {'eager' if eager else 'graphs'}"
                row = run_mesh(mesh, prompts, 128, concurrency, engine=engine)
                rows.append(
                    [
                        row.engine,
                        str(concurrency),
                        f"{row.output_tokens_per_s:.1f}",
                        f"{row.ttft_p50_ms:.1f}",
                        f"{row.itl_p50_ms:.2f}",
                    ]
                )
        finally:
            mesh.stop()
    agree = "n/a (1 GPU)" if "tp2" not in tokens else str(tokens["tp1"] == tokens["tp2"])
    graphs_agree = tokens["tp1"] == tokens["tp1-eager"]
    write_results(
        "gpu_check",
        f"GPU: {torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}; "
        f"W64 model, 16 requests x 128 + 128 tokens; tp=1 and tp=2 tokens equal: {agree}; "
        f"CUDA graphs and eager tokens equal: {graphs_agree}; "
        f"KV cache sizing: {sizing}; JSON-schema outputs valid: {structured}",
        ["engine", "concurrency", "output tok/s", "TTFT p50 ms", "ITL p50 ms"],
        rows,
        rows,
    )


SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}


def constrained_valid(mesh: Mesh, prompts: list[list[int]]) -> str:
    """How many of the prompts, held to SCHEMA, ended in a JSON value that has its keys."""
    valid = 0
    for prompt in prompts:
        request = greedy_request(prompt, 64)
        request.stopping.ignore_eos = False
        request.constraint.json_schema = json.dumps(SCHEMA)
        result = mesh.generate(request)
        try:
            valid += set(json.loads(result.text)) == {"city", "days"}
        except ValueError:
            pass
    return f"{valid}/{len(prompts)}"


if __name__ == "__main__":
    main()
