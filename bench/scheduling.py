"""The scheduler's figures through the whole mesh, each against a baseline of the same run:

- TTFT of a request whose 1024-token prefix is already cached vs the same shape cold;
- 64 concurrent requests (128-token prompts, 128 new tokens) vs the same one at a time;
- preemption by recompute vs by swap, on a KV cache too small for the batch.

    .venv/bin/python -m bench.scheduling [--model PATH] [--num-requests 64]

The default model is PEERS.md's W64 random Llama (56M parameters), written on first use.
Writes bench/results/scheduling.{json,md}.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import REPO_ROOT, run_mesh, write_results, write_w64_model
from pagemesh.tools.mesh_process import Mesh, greedy_request

PREFIX_LEN = 1024


def ttft_s(mesh: Mesh, prompt: list[int]) -> float:
    start = time.perf_counter()
    for chunk in mesh.stub.Generate(greedy_request(prompt, 1)):
        if chunk.token_ids:
            return time.perf_counter() - start
    raise RuntimeError("no token")


def prefix_ttft(mesh: Mesh, vocab: int, trials: int) -> tuple[float, float]:
    """Median TTFT (s) cold and with the prefix cached, prompts of 1024 + 16 tokens."""
    rng = random.Random(1)
    cold, warm = [], []
    for _ in range(trials):
        prefix = [rng.randrange(1, vocab) for _ in range(PREFIX_LEN)]
        cold.append(ttft_s(mesh, prefix + [rng.randrange(1, vocab) for _ in range(16)]))
        warm.append(ttft_s(mesh, prefix + [rng.randrange(1, vocab) for _ in range(16)]))
    return statistics.median(cold), statistics.median(warm)


def start_mesh(model: str, name: str, extra: list[str]) -> Mesh:
    return Mesh(
        model, Path(tempfile.mkdtemp()) / f"{name}.log", cluster=f"bench-{name}", extra_args=extra
    ).wait_ready()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--ttft-trials", type=int, default=5)
    args = parser.parse_args()
    model = args.model or str(write_w64_model(REPO_ROOT / ".cache" / "w64-llama"))
    vocab = 32000
    rng = random.Random(0)
    prompts = [
        [rng.randrange(1, vocab) for _ in range(args.prompt_len)] for _ in range(args.num_requests)
    ]
    figures: dict[str, float] = {}
    rows: list[list[str]] = []

    mesh = start_mesh(model, "main", ["--max-num-seqs", "256"])
    try:
        mesh.generate(greedy_request(prompts[0], 4))  # warm-up
        cold, warm = prefix_ttft(mesh, vocab, args.ttft_trials)
        figures.update(ttft_cold_ms=1000 * cold, ttft_cached_ms=1000 * warm)
        rows.append(
            [
                "TTFT, 1024-token prefix",
                f"cold {1000 * cold:.1f} ms",
                f"cached {1000 * warm:.1f} ms",
                f"{warm / cold:.2f}x",
            ]
        )
        one = run_mesh(mesh, prompts, args.max_tokens, 1)
        many = run_mesh(mesh, prompts, args.max_tokens, args.num_requests)
        figures.update(
            sequential_tok_s=one.output_tokens_per_s, concurrent_tok_s=many.output_tokens_per_s
        )
        rows.append(
            [
                f"{args.num_requests} requests x {args.prompt_len}+{args.max_tokens} tokens",
                f"one at a time {one.output_tokens_per_s:.1f} tok/s",
                f"all at once {many.output_tokens_per_s:.1f} tok/s",
                f"{many.output_tokens_per_s / one.output_tokens_per_s:.2f}x",
            ]
        )
    finally:
        mesh.stop()

    # A cache of 48 blocks x 16 tokens holds ~3 of these requests: the rest preempt.
    small = prompts[: min(16, args.num_requests)]
    preempt = {}
    for mode in ("recompute", "swap"):
        mesh = start_mesh(model, mode, ["--num-kv-blocks", "48", "--preemption-mode", mode])
        try:
            preempt[mode] = run_mesh(mesh, small, args.max_tokens, len(small))
        finally:
            mesh.stop()
    recompute_tok_s = preempt["recompute"].output_tokens_per_s
    swap_tok_s = preempt["swap"].output_tokens_per_s
    figures.update(recompute_tok_s=recompute_tok_s, swap_tok_s=swap_tok_s)
    rows.append(
        [
            f"{len(small)} requests on a 48-block cache (preemption)",
            f"recompute {recompute_tok_s:.1f} tok/s",
            f"swap {swap_tok_s:.1f} tok/s",
            f"swap/recompute {swap_tok_s / recompute_tok_s:.2f}x",
        ]
    )
    write_results(
        "scheduling",
        f"Model {Path(model).name}, fp32, 2-core CPU; greedy, EOS ignored; one run.",
        ["what", "baseline", "measured", "ratio"],
        rows,
        figures,
    )


if __name__ == "__main__":
    main()
