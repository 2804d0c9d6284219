"""What OpenTelemetry tracing costs, through the whole mesh and in-process:

- throughput of the same workload with every service exporting its spans over OTLP/gRPC to a
  receiver in this process vs tracing off (no endpoint), runs interleaved (off, on, on, off,
  ...) with one mesh alive at a time so machine noise hits both; medians reported;
- the CPU time per step of the scheduler's request-span hooks and the worker's step span
  (64 requests in the batch), measured in-process with a real SDK provider, batch processor
  and OTLP exporter to the same receiver: free of the whole-mesh noise (±15% run to run).

    .venv/bin/python -m bench.tracing [--model PATH] [--rounds 3]

The default model is PEERS.md's W64 random Llama, written on first use.
Writes bench/results/tracing.{json,md}.
"""

from __future__ import annotations

import argparse
import contextvars
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import add_w64_workload_args, run_mesh, w64_workload, write_results
from pagemesh.tools.mesh_process import Mesh, greedy_request
from pagemesh.tools.testing.otlp_receiver import OtlpReceiver


def mesh_tok_s(
    model: str, prompts: list[list[int]], max_tokens: int, endpoint: str | None
) -> float:
    """Output tokens/s of all `prompts` at once on a fresh mesh (tracing on iff `endpoint`)."""
    extra = ["--otlp-traces-endpoint", endpoint] if endpoint else []
    name = "tracing-on" if endpoint else "tracing-off"
    mesh = Mesh(
        model, Path(tempfile.mkdtemp()) / f"{name}.log", cluster=f"bench-{name}", extra_args=extra
    ).wait_ready()
    try:
        list(mesh.stub.Generate(greedy_request(prompts[0][:8], 4)))  # warm-up
        return run_mesh(mesh, prompts, max_tokens, len(prompts)).output_tokens_per_s
    finally:
        mesh.stop()


def _provider(endpoint: str) -> Any:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider


def scheduler_cpu_ms_per_step(
    tracer: Any, num_requests: int, prompt_len: int, max_tokens: int
) -> tuple[float, int]:
    """CPU ms per step (all threads: the exporter's too) of the scheduler core driven through
    `num_requests` requests with the tracing hooks the engine loop calls; and the steps."""
    from bench.scheduler_core import made_up_result
    from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
    from scheduler_svc.core.types import Request, RequestId, SamplingParams
    from scheduler_svc.tracing import RequestTracing

    scheduler = Scheduler(SchedulerConfig(num_blocks=4096, block_size=16))
    tracing = RequestTracing(tracer)
    rng = random.Random(0)
    start = time.process_time()
    states = []
    for i in range(num_requests):
        request = Request(
            RequestId(f"r{i}"),
            [rng.randrange(3, 32000) for _ in range(prompt_len)],
            SamplingParams(),
            max_tokens=max_tokens,
        )
        scheduler.add_request(request)
        states.append(
            contextvars.copy_context().run(tracing.start, f"r{i}", [request], prompt_len, False)
        )
    num_steps = 0
    while scheduler.has_work():
        output = scheduler.schedule()
        tracing.on_scheduled(output, scheduler.requests)
        tracing.on_events(scheduler.update(output, made_up_result(scheduler, output)))
        num_steps += 1
    for state in states:
        tracing.end(state)
    return 1000 * (time.process_time() - start) / num_steps, num_steps


def worker_cpu_ms_per_step(tracer: Any, num_requests: int, num_steps: int) -> float:
    """CPU ms of one decode step's `execute_step` span linked to `num_requests` requests."""
    from opentelemetry import trace

    from pagemesh.runtime.telemetry import traceparent
    from protos.pagemesh.worker.v1 import worker_pb2
    from worker_svc.tracing import start_step_span

    parents = [tracer.start_span("Submit") for _ in range(num_requests)]
    step = worker_pb2.ExecuteStepRequest(
        cached_requests=[worker_pb2.CachedRequest(request_id=f"r{i}") for i in range(num_requests)],
        num_scheduled_tokens={f"r{i}": 1 for i in range(num_requests)},
        traceparents={f"r{i}": traceparent(p) for i, p in enumerate(parents)},
    )
    layout = {"tp_rank": 0, "pp_rank": 0}
    start = time.process_time()
    for step_id in range(num_steps):
        step.step_id = step_id
        span = start_step_span(tracer, step, "w0", layout)
        with trace.use_span(span, end_on_exit=True):
            span.set_attribute("pagemesh.step.forward_time_ms", 1.0)
    return 1000 * (time.process_time() - start) / num_steps


def in_process_costs(
    endpoint: str, num_requests: int, prompt_len: int, max_tokens: int, repeats: int = 3
) -> dict[str, float]:
    """Median CPU ms per step, tracing on minus off, of the scheduler's and the worker's span
    work; the provider is flushed inside the timed region so export encoding counts."""
    from opentelemetry.trace import NoOpTracer

    on, off, worker = [], [], []
    for _ in range(repeats):
        off.append(scheduler_cpu_ms_per_step(NoOpTracer(), num_requests, prompt_len, max_tokens)[0])
        provider = _provider(endpoint)
        ms, num_steps = scheduler_cpu_ms_per_step(
            provider.get_tracer("bench"), num_requests, prompt_len, max_tokens
        )
        start = time.process_time()
        provider.force_flush()
        on.append(ms + 1000 * (time.process_time() - start) / num_steps)
        start = time.process_time()
        worker_ms = worker_cpu_ms_per_step(provider.get_tracer("bench"), num_requests, num_steps)
        provider.force_flush()
        worker.append(worker_ms + 1000 * (time.process_time() - start) / num_steps)
        provider.shutdown()
    return {
        "scheduler_off_ms": statistics.median(off),
        "scheduler_on_ms": statistics.median(on),
        "worker_on_ms": statistics.median(worker),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_w64_workload_args(parser)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model, prompts = w64_workload(args)
    os.environ.setdefault("OTEL_BSP_SCHEDULE_DELAY", "1000")  # the SDK's default, made explicit
    runs: dict[str, list[float]] = {"off": [], "on": []}
    with OtlpReceiver(keep=False) as receiver:
        for round_index in range(args.rounds):
            for mode in ("off", "on") if round_index % 2 == 0 else ("on", "off"):
                endpoint = receiver.endpoint if mode == "on" else None
                runs[mode].append(mesh_tok_s(model, prompts, args.max_tokens, endpoint))
                print(f"round {round_index} tracing {mode}: {runs[mode][-1]:.1f} tok/s", flush=True)
        num_spans = receiver.num_spans
        costs = in_process_costs(
            receiver.endpoint, args.num_requests, args.prompt_len, args.max_tokens
        )
    report(args, runs, num_spans, costs)


def report(
    args: argparse.Namespace, runs: dict[str, list[float]], num_spans: int, costs: dict[str, float]
) -> None:
    off, on = statistics.median(runs["off"]), statistics.median(runs["on"])
    rounds = lambda values: ", ".join(f"{v:.1f}" for v in values)  # noqa: E731
    scheduler_ms = costs["scheduler_on_ms"] - costs["scheduler_off_ms"]
    rows = [
        ["tracing off (no endpoint)", f"{off:.1f}", "1.000x", rounds(runs["off"]), "0"],
        [
            "tracing on, OTLP/gRPC to an in-process receiver",
            f"{on:.1f}",
            f"{on / off:.3f}x",
            rounds(runs["on"]),
            str(num_spans),
        ],
        [
            f"scheduler span hooks, CPU ms/step ({args.num_requests} requests, in-process)",
            f"{scheduler_ms:.3f}",
            "",
            f"core alone {costs['scheduler_off_ms']:.3f}",
            "",
        ],
        [
            f"worker step span with {args.num_requests} links, CPU ms/step (in-process)",
            f"{costs['worker_on_ms']:.3f}",
            "",
            "",
            "",
        ],
    ]
    write_results(
        "tracing",
        f"Tracing cost, {args.num_requests} requests x {args.prompt_len}+{args.max_tokens} tokens "
        f"at once, W64 model, CPU, median of {args.rounds} interleaved rounds (bench/tracing.py)",
        ["run", "output tok/s", "vs off", "per round", "spans exported"],
        rows,
        {"tok_s": runs, "num_spans": num_spans, "in_process_cpu_ms_per_step": costs},
    )


if __name__ == "__main__":
    main()
