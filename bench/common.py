"""What the benchmarks share: streaming timers, the W64 model, table output."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from pagemesh.tools.loadgen.machine import machine_markdown, machine_record  # noqa: E402
from pagemesh.tools.mesh_process import Mesh, greedy_request  # noqa: E402

RESULTS = REPO_ROOT / "bench" / "results"
# Raw samples (every TTFT, every gap): regenerable, megabytes, so ignored by git; the
# committed files are the Markdown, the plots and summary JSON of the figures.
RAW_RESULTS = RESULTS / "raw"


@dataclass
class Row:
    engine: str
    concurrency: int
    num_requests: int
    output_tokens_per_s: float
    ttft_p50_ms: float
    itl_p50_ms: float
    e2e_p50_ms: float


def timed_stream(mesh: Mesh, prompt: list[int], max_tokens: int) -> tuple[float, list[float], int]:
    """(time to first token, inter-token gaps, number of tokens) of one streamed request, in s."""
    start = time.perf_counter()
    arrivals: list[float] = []
    for chunk in mesh.stub.Generate(greedy_request(prompt, max_tokens)):
        arrivals += [time.perf_counter()] * len(chunk.token_ids)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return arrivals[0] - start, gaps, len(arrivals)


def run_mesh(
    mesh: Mesh,
    prompts: list[list[int]],
    max_tokens: int,
    concurrency: int,
    engine: str = "pagemesh (gRPC, streamed)",
) -> Row:
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: timed_stream(mesh, p, max_tokens), prompts))
    wall_s = time.perf_counter() - start
    gaps = [g for r in results for g in r[1]]
    return Row(
        engine,
        concurrency,
        len(prompts),
        sum(r[2] for r in results) / wall_s,
        1000 * statistics.median(r[0] for r in results),
        1000 * statistics.median(gaps) if gaps else float("nan"),
        1000 * statistics.median(r[0] + sum(r[1]) for r in results),
    )


def write_w64_model(folder: Path) -> Path:
    """The random Llama of PEERS.md's W64 figures: hidden 512, intermediate 1408, 8 layers,
    8 heads / 4 KV heads, vocab 32k (56M parameters)."""
    from pagemesh.tools.testing.tiny_models import write_tiny_model

    if (folder / "config.json").exists():
        return folder
    return write_tiny_model(
        folder,
        "llama",
        seed=0,
        std=0.02,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=32000,
        max_position_embeddings=2048,
    )


def write_w64_moe_model(folder: Path) -> Path:
    """W64's model as a mixture of experts: the same attention, 8 layers and vocabulary, each
    MLP a Qwen3-MoE block of 8 experts of intermediate 704, 2 per token (the dense model's
    1,408 active per token; 4x its MLP weights in all)."""
    from pagemesh.tools.testing.tiny_models import write_tiny_model

    if (folder / "config.json").exists():
        return folder
    return write_tiny_model(
        folder,
        "qwen3_moe",
        seed=0,
        std=0.02,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        vocab_size=32000,
        max_position_embeddings=2048,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=704,
        norm_topk_prob=True,
    )


def add_w64_workload_args(parser: argparse.ArgumentParser) -> None:
    """The flags of the W64 workload: model, number of requests, prompt and output lengths."""
    parser.add_argument("--model", default=None, help="default: PEERS.md's W64 random Llama")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)


def w64_workload(args: argparse.Namespace) -> tuple[str, list[list[int]]]:
    """(model path, prompts) of `add_w64_workload_args`' flags; prompts from a fixed seed."""
    import random

    model = args.model or str(write_w64_model(REPO_ROOT / ".cache" / "w64-llama"))
    rng = random.Random(0)
    return model, [
        [rng.randrange(1, 32000) for _ in range(args.prompt_len)] for _ in range(args.num_requests)
    ]


def write_results(
    name: str,
    header: str,
    columns: list[str],
    rows: list[list[str]],
    data: object,
    raw: object = None,
) -> str:
    """bench/results/<name>.md (the machine line, `header`, the table) and <name>.json
    ({"machine": ..., "results": data}: figures, not samples); `raw`, when given, to
    bench/results/raw/<name>.json in the same shape."""
    machine = machine_record()
    lines = [
        header,
        "",
        machine_markdown(machine),
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    table = "\n".join(lines)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.md").write_text(table + "\n")
    (RESULTS / f"{name}.json").write_text(
        json.dumps({"machine": machine, "results": data}, indent=2, default=asdict) + "\n"
    )
    if raw is not None:
        RAW_RESULTS.mkdir(parents=True, exist_ok=True)
        (RAW_RESULTS / f"{name}.json").write_text(
            json.dumps({"machine": machine, "results": raw}, default=asdict) + "\n"
        )
    print(table)
    return table
