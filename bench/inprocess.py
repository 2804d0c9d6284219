"""The engine core in one process: the engine loop the scheduler service runs, driving the
model runner in this process (`InprocExecutor`), no gRPC and no other process.

Each step is what a pagemesh step is — `Scheduler.schedule()`, `ModelRunner.execute_step`
on the model thread (the step's own types: no protobuf in one process), `Scheduler.update()`, the
events
handed to their sink — with every request submitted at once. Against `pagemesh bench` on a
mesh with the same settings, the difference is what the mesh costs: processes, two gRPC
hops, streaming to clients.

    .venv/bin/python -m bench.inprocess [--dtype bfloat16] [--num-requests 64] [--cpu-linear onednn]

TTFT and ITL come from the engine's clock: a token "arrives" when its sink gets it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time

import torch

from pagemesh.tools.loadgen.machine import machine_record
from pagemesh.tools.loadgen.result import RunResult
from protos.step import RequestId, SamplingParams
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.types import Request, RequestEvent
from scheduler_svc.engine_loop import EngineLoop
from scheduler_svc.executor import InprocExecutor, model_thread
from worker_svc.runner import ModelRunner
from worker_svc.runner_config import RunnerConfig


def build_engine(
    model: str,
    dtype: str = "float32",
    max_num_seqs: int = 128,
    max_num_batched_tokens: int = 2048,
    threads: int = 0,
    enable_prefix_caching: bool = True,
    async_scheduling: bool = True,
    cpu_linear: str = "auto",
) -> tuple[Scheduler, ModelRunner]:
    """A scheduler core sized from a runner, as `pagemesh up` sizes them by default."""
    if threads:
        torch.set_num_threads(threads)
    thread = model_thread()  # the runner loads on the thread its steps run on
    runner = thread.submit(
        ModelRunner.from_config, RunnerConfig(model_path=model, dtype=dtype, cpu_linear=cpu_linear)
    ).result()  # KV sized as `up`
    runner.model_thread = thread
    info = runner.info()
    scheduler = Scheduler(
        SchedulerConfig(
            num_blocks=info.num_blocks,
            block_size=info.block_size,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=info.max_model_len,
            enable_prefix_caching=enable_prefix_caching,
            async_scheduling=async_scheduling,
        )
    )
    return scheduler, runner


class _Arrivals:
    """The sink of every benchmark request: token arrival times, and when all ended."""

    def __init__(self, num_requests: int) -> None:
        self.times: dict[str, list[float]] = {}
        self.num_unfinished = num_requests
        self.done = asyncio.Event()

    def deliver(self, events: list[RequestEvent]) -> None:
        now = time.perf_counter()
        for event in events:
            self.times.setdefault(event.request_id, []).extend([now] * len(event.new_tokens))
            if event.finish_reason is not None:
                self.num_unfinished -= 1
        if self.num_unfinished <= 0:
            self.done.set()

    def fail(self, request_id: RequestId, message: str) -> None:
        raise RuntimeError(f"request {request_id} failed in-process: {message}")


async def _run(loop: EngineLoop, requests: list[Request]) -> _Arrivals:
    arrivals = _Arrivals(len(requests))
    for request in requests:
        loop.submit([request], arrivals)
    task = asyncio.create_task(loop.run())
    try:
        await arrivals.done.wait()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task  # its steps not yet started are cancelled with it
        await loop.workers.close()
    return arrivals


def run_requests(
    scheduler: Scheduler,
    runner: ModelRunner,
    prompts: list[list[int]],
    max_tokens: int,
    engine: str = "engine core in-process",
    workload: str = "w64",
) -> RunResult:
    """Greedy, EOS ignored, all requests at once, through one EngineLoop."""
    start = time.perf_counter()
    requests = [
        Request(
            request_id=RequestId(f"bench-{i}"),
            prompt_token_ids=list(prompt),
            sampling=SamplingParams(temperature=0.0, seed=i),
            max_tokens=max_tokens,
            arrival_time_s=start,
        )
        for i, prompt in enumerate(prompts)
    ]
    loop = EngineLoop(
        scheduler, InprocExecutor(runner.execute_step, runner.model_thread, close_thread=False)
    )  # the next run's too
    arrivals = asyncio.run(_run(loop, requests)).times
    duration = time.perf_counter() - start
    return RunResult(
        engine=engine,
        workload=workload,
        dtype=runner.info().dtype,
        concurrency=0,
        num_requests=len(prompts),
        prompt_tokens=sum(map(len, prompts)),
        output_tokens=sum(map(len, arrivals.values())),
        duration_s=duration,
        ttft_ms=[1000 * (times[0] - start) for times in arrivals.values() if times],
        itl_ms=[1000 * (b - a) for times in arrivals.values() for a, b in zip(times, times[1:])],
        e2e_ms=[1000 * (times[-1] - start) for times in arrivals.values() if times],
    )


def one_at_a_time(
    scheduler: Scheduler, runner: ModelRunner, prompts: list[list[int]], max_tokens: int
) -> RunResult:
    """Each prompt alone (batch 1), one after the other: the runs' samples together, their
    durations summed."""
    runs = [run_requests(scheduler, runner, [prompt], max_tokens) for prompt in prompts]
    first = runs[0]
    return RunResult(
        engine="engine core in-process, one at a time",
        workload=first.workload,
        dtype=first.dtype,
        concurrency=1,
        num_requests=len(runs),
        prompt_tokens=sum(r.prompt_tokens for r in runs),
        output_tokens=sum(r.output_tokens for r in runs),
        duration_s=sum(r.duration_s for r in runs),
        ttft_ms=[t for r in runs for t in r.ttft_ms],
        itl_ms=[t for r in runs for t in r.itl_ms],
        e2e_ms=[t for r in runs for t in r.e2e_ms],
    )


def main(argv: list[str] | None = None) -> None:
    from bench.common import REPO_ROOT, write_w64_model
    from pagemesh.tools.loadgen.workloads import build_workload

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="default: the W64 random Llama")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    parser.add_argument("--cpu-linear", default="auto", help="auto | native | onednn | torch")
    parser.add_argument(
        "--one-at-a-time",
        action="store_true",
        help="batch 1: each request alone, the next after it ends",
    )
    parser.add_argument("--json", default=None, help="write the RunResult here")
    args = parser.parse_args(argv)
    model = args.model or str(write_w64_model(REPO_ROOT / ".cache" / "w64-llama"))
    workload = build_workload(
        "w64",
        num_requests=args.num_requests,
        prompt_len=args.prompt_len,
        max_tokens=args.max_tokens,
    )
    prompts = [r.prompt_token_ids for r in workload.requests]
    scheduler, runner = build_engine(
        model,
        args.dtype,
        max_num_seqs=args.max_num_seqs,
        threads=args.threads,
        cpu_linear=args.cpu_linear,
    )
    run_requests(scheduler, runner, [p[:8] for p in prompts[:4]], 4, workload="warm-up")
    if args.one_at_a_time:
        result = one_at_a_time(scheduler, runner, prompts, args.max_tokens)
    else:
        result = run_requests(scheduler, runner, prompts, args.max_tokens)
    summary = result.summary()
    print(
        f"{result.engine} {result.dtype}, linear {runner.cpu_linear}: "
        f"{result.output_tok_s:.1f} tok/s, "
        f"TTFT p50 {summary['ttft_ms']['p50']:.1f} ms, ITL p50 {summary['itl_ms']['p50']:.1f} ms"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**result.to_json(), "machine": machine_record()}, f)


if __name__ == "__main__":
    main()
