"""Continuous batching through the whole mesh vs one request at a time, and vs
`transformers` generating the same requests in the same process, all in one run.

    .venv/bin/python -m bench.concurrency                 # SmolLM2 (the default model)
    .venv/bin/python -m bench.concurrency --model PATH

Prints a table and writes bench/results/concurrency.{json,md}.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import Row, run_mesh, write_results
from pagemesh.runtime.models import default_model_path
from pagemesh.tools.mesh_process import Mesh, greedy_request


def run_transformers(model_path: str, prompts: list[list[int]], max_tokens: int) -> Row:
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(model_path)
    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    e2e = []
    with torch.inference_mode():
        for i, prompt in enumerate([prompts[0], *prompts]):  # the first one warms up
            ids = torch.tensor([prompt])
            start = time.perf_counter()
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            if i:
                e2e.append(time.perf_counter() - start)
    return Row(
        "transformers generate, sequential",
        1,
        len(prompts),
        max_tokens * len(prompts) / sum(e2e),
        float("nan"),
        1000 * statistics.median(e2e) / max_tokens,
        1000 * statistics.median(e2e),
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="model the mesh serves (default: SmolLM2)")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    args = parser.parse_args()
    model = args.model or default_model_path()
    rng = random.Random(0)
    prompts = [
        [rng.randrange(1, 30000) for _ in range(args.prompt_len)] for _ in range(args.num_requests)
    ]

    mesh = Mesh(model, Path(tempfile.mkdtemp()) / "mesh.log", cluster="bench").wait_ready()
    try:
        mesh.generate(greedy_request(prompts[0], 4))  # warm-up
        rows = [run_mesh(mesh, prompts, args.max_tokens, c) for c in args.concurrency]
    finally:
        mesh.stop()
    rows.append(run_transformers(model, prompts, args.max_tokens))
    baseline = rows[0].output_tokens_per_s
    write_results(
        "concurrency",
        f"Workload: {args.num_requests} requests x {args.prompt_len} prompt tokens x "
        f"{args.max_tokens} new tokens, greedy, EOS ignored; model {Path(model).name}; fp32 CPU.",
        [
            "engine",
            "concurrency",
            "output tok/s",
            "vs pagemesh c=1",
            "TTFT p50 ms",
            "ITL p50 ms",
            "e2e p50 ms",
        ],
        [
            [
                r.engine,
                str(r.concurrency),
                f"{r.output_tokens_per_s:.1f}",
                f"{r.output_tokens_per_s / baseline:.2f}x",
                f"{r.ttft_p50_ms:.1f}",
                f"{r.itl_p50_ms:.1f}",
                f"{r.e2e_p50_ms:.0f}",
            ]
            for r in rows
        ],
        rows,
    )


if __name__ == "__main__":
    main()
