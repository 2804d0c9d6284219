"""A fresh mesh with its KV cache's pages faulted in while idle, against one that faults
them inside its steps (`pagemesh up --kv-prefault-steps 0`, the behaviour before).

    .venv/bin/python -m bench.kv_prefault [--idle-s 5] [--model DIR]

For each setting a fresh `pagemesh up` on SmolLM2-135M fp32 (the HF folder
`bench.versus_vllm` writes), left idle `--idle-s` seconds after it is ready (what a server
between deploys and its first users has), then: one request at a time with a 128-token
prompt, TTFT p50 over 6 (`first token`; each prompt new, so new blocks), then W64 (64 x 128
prompt ids x 128 new tokens, all at once) output tok/s, then W64 again straight after (no
idle time: those blocks are faulted in by the steps in both settings). The two meshes run one
after the other in this process; the ratios compare them. Writes
bench/results/kv_prefault.{md,json}.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import REPO_ROOT, write_results
from bench.control_plane import write_smollm2_folder
from pagemesh.tools.loadgen import Target, build_workload, run_workload
from pagemesh.tools.mesh_process import Mesh, greedy_request

SETTINGS = {
    "lazy (--kv-prefault-steps 0)": ["--kv-prefault-steps", "0"],
    "faulted in while idle (default)": [],
}


def ttft_ms(mesh: Mesh, rng: random.Random, prompt_len: int = 128) -> float:
    request = greedy_request([rng.randrange(100, 40000) for _ in range(prompt_len)], 1)
    start = time.perf_counter()
    for chunk in mesh.stub.Generate(request, timeout=120):
        if chunk.token_ids:
            return 1000 * (time.perf_counter() - start)
    raise RuntimeError("no token came back")


def measure(model: str, flags: list[str], idle_s: float) -> dict:
    log = Path(tempfile.mkdtemp()) / "mesh.log"
    mesh = Mesh(model, log, cluster="kv-prefault", extra_args=flags).wait_ready()
    try:
        time.sleep(idle_s)
        rng = random.Random(7)
        ttft = statistics.median(ttft_ms(mesh, rng) for _ in range(6))
        w64 = []
        for seed in (0, 2):
            result = run_workload(
                Target(mesh.address),
                build_workload("w64", num_requests=64, max_tokens=128, seed=seed),
                warmup=0,
            )
            w64.append(result.output_tokens / result.duration_s)
        return {"ttft_ms": ttft, "w64_first_tok_s": w64[0], "w64_next_tok_s": w64[1]}
    finally:
        mesh.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idle-s", type=float, default=5.0)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M fp32 HF folder")
    args = parser.parse_args()
    model = args.model or str(write_smollm2_folder(REPO_ROOT / ".cache" / "smollm2-hf"))
    results = {name: measure(model, flags, args.idle_s) for name, flags in SETTINGS.items()}
    lazy, warm = results.values()
    rows = [
        [name, f"{r['ttft_ms']:.1f}", f"{r['w64_first_tok_s']:.1f}", f"{r['w64_next_tok_s']:.1f}"]
        for name, r in results.items()
    ]
    rows.append(
        [
            "ratio (faulted in / lazy)",
            f"{warm['ttft_ms'] / lazy['ttft_ms']:.2f}x",
            f"{warm['w64_first_tok_s'] / lazy['w64_first_tok_s']:.2f}x",
            f"{warm['w64_next_tok_s'] / lazy['w64_next_tok_s']:.2f}x",
        ]
    )
    header = (
        f"A fresh mesh's KV pages faulted in while idle against on first use: "
        f"SmolLM2-135M fp32, idle {args.idle_s:g} s after start; batch-1 TTFT of a "
        f"128-token prompt (p50 of 6), then W64 twice back to back. Command: "
        f"`python -m bench.kv_prefault`."
    )
    write_results(
        "kv_prefault",
        header,
        ["KV pages", "batch-1 TTFT p50 ms", "first W64 tok/s", "next W64 tok/s"],
        rows,
        results,
    )


if __name__ == "__main__":
    main()
