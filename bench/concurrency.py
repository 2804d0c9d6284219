"""Continuous batching through the whole mesh vs one request at a time, and vs
`transformers` generating the same requests in the same process, all in one run.

    .venv/bin/python bench/concurrency.py                 # starts `pagemesh up` itself
    .venv/bin/python bench/concurrency.py --address HOST:PORT --model PATH

Prints a table and writes bench/results/concurrency.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from pagemesh.models import default_model_path  # noqa: E402
from tests.mesh_harness import Mesh, greedy_request  # noqa: E402


@dataclass
class Row:
    engine: str
    concurrency: int
    num_requests: int
    output_tokens_per_s: float
    ttft_p50_ms: float
    itl_p50_ms: float
    e2e_p50_ms: float


def timed_stream(stub: object, prompt: list[int], max_tokens: int) -> tuple[float, list[float], int]:
    """Returns (time to first token, inter-token gaps, tokens) of one streamed request, in s."""
    start = time.perf_counter()
    arrivals: list[float] = []
    num_tokens = 0
    for chunk in stub.Generate(greedy_request(prompt, max_tokens)):  # type: ignore[attr-defined]
        now = time.perf_counter()
        arrivals += [now] * len(chunk.token_ids)
        num_tokens += len(chunk.token_ids)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return arrivals[0] - start, gaps, num_tokens


def run_mesh(mesh: Mesh, prompts: list[list[int]], max_tokens: int, concurrency: int) -> Row:
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: timed_stream(mesh.stub, p, max_tokens), prompts))
    wall_s = time.perf_counter() - start
    ttfts = [r[0] for r in results]
    gaps = [g for r in results for g in r[1]]
    tokens = sum(r[2] for r in results)
    e2e = [r[0] + sum(r[1]) for r in results]
    return Row("pagemesh (gRPC, streamed)", concurrency, len(prompts), tokens / wall_s,
               1000 * statistics.median(ttfts), 1000 * statistics.median(gaps),
               1000 * statistics.median(e2e))


def run_transformers(model_path: str, prompts: list[list[int]], max_tokens: int) -> Row:
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(model_path)
    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    e2e = []
    with torch.inference_mode():
        warm = torch.tensor([prompts[0]])
        model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=2, do_sample=False,
                       pad_token_id=0)
        for prompt in prompts:
            ids = torch.tensor([prompt])
            start = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                           min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
            e2e.append(time.perf_counter() - start)
    tokens = max_tokens * len(prompts)
    return Row("transformers generate, sequential", 1, len(prompts), tokens / sum(e2e),
               float("nan"), 1000 * statistics.median(e2e) / max_tokens,
               1000 * statistics.median(e2e))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model the mesh serves (default: SmolLM2)")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--out", default=str(REPO_ROOT / "bench" / "results" / "concurrency"))
    args = parser.parse_args()
    model = args.model or default_model_path()
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 30000) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]

    log = Path(tempfile.mkdtemp()) / "mesh.log"
    mesh = Mesh(model, log, cluster="bench").wait_ready()
    try:
        mesh.generate(greedy_request(prompts[0], 4))  # warm-up
        rows = [run_mesh(mesh, prompts, args.max_tokens, c) for c in args.concurrency]
    finally:
        mesh.stop()
    rows.append(run_transformers(model, prompts, args.max_tokens))
    baseline = rows[0].output_tokens_per_s
    lines = [
        f"Workload: {args.num_requests} requests x {args.prompt_len} prompt tokens x "
        f"{args.max_tokens} new tokens, greedy, EOS ignored; model {Path(model).name}; fp32 CPU.",
        "",
        "| engine | concurrency | output tok/s | vs pagemesh c=1 | TTFT p50 ms | ITL p50 ms | e2e p50 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r.engine} | {r.concurrency} | {r.output_tokens_per_s:.1f} | "
                     f"{r.output_tokens_per_s / baseline:.2f}x | {r.ttft_p50_ms:.1f} | "
                     f"{r.itl_p50_ms:.1f} | {r.e2e_p50_ms:.0f} |")
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(table + "\n")
    out.with_suffix(".json").write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")


if __name__ == "__main__":
    main()
