"""The scheduler core's own cost per step: `schedule()` + `update()` with N running decodes.

    .venv/bin/python -m bench.scheduler_core            # 16, 256, 1024 running requests
    .venv/bin/python -m bench.scheduler_core --steps 64 --repeats 3

Each request has a 128-token prompt whose first 64 tokens are shared by all, so the prefix
cache is live; all prompts are prefilled and a few decode steps taken before timing. The
step result is built outside the timed region. Baseline rows in the same run: the same
workload with prefix caching off, and per-request cost relative to 16 requests. Prints a
Markdown table and writes bench/results/scheduler_core.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from pagemesh.tools.loadgen.machine import machine_markdown, machine_record  # noqa: E402
from protos.step import ModelRunnerOutput, RequestId, SampledToken, SamplingParams, SchedulerOutput  # noqa: E402
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from scheduler_svc.core.types import Request  # noqa: E402

BLOCK_SIZE = 16
PROMPT_LEN = 128
SHARED_PREFIX_LEN = 64


@dataclass
class Row:
    num_running: int
    prefix_caching: bool
    schedule_us: float
    update_us: float
    step_ms: float
    us_per_request: float
    num_cached_blocks: int


def build(num_running: int, prefix_caching: bool, num_steps: int) -> Scheduler:
    """A scheduler with `num_running` requests decoding (prefilled, a few steps in)."""
    max_tokens = num_steps + 128  # never reached: every request stays running
    blocks_per_request = -(-(PROMPT_LEN + max_tokens) // BLOCK_SIZE)
    scheduler = Scheduler(
        SchedulerConfig(
            num_blocks=num_running * blocks_per_request + 16,
            block_size=BLOCK_SIZE,
            max_num_batched_tokens=8192,
            max_num_seqs=num_running,
            max_model_len=4096,
            enable_prefix_caching=prefix_caching,
        )
    )
    shared = list(range(1000, 1000 + SHARED_PREFIX_LEN))
    for i in range(num_running):
        unique = [(i * 7919 + j) % 30000 + 2000 for j in range(PROMPT_LEN - SHARED_PREFIX_LEN)]
        scheduler.add_request(
            Request(RequestId(f"r{i}"), shared + unique, SamplingParams(), max_tokens=max_tokens)
        )
    while len(scheduler.running) < num_running or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running
    ):
        run_step(scheduler)
    for _ in range(16):
        run_step(scheduler)
    return scheduler


def made_up_result(
    scheduler: Scheduler, output: SchedulerOutput, token_id: int = 5
) -> ModelRunnerOutput:
    """What a worker would answer, without a model: `token_id` for every request whose
    scheduled tokens reached its end."""
    requests = scheduler.requests
    sampled = {
        rid: SampledToken(token_id)
        for rid in output.num_scheduled_tokens
        if requests[rid].num_computed_tokens == requests[rid].num_tokens
    }
    return ModelRunnerOutput(output.step_id, sampled)


def run_step(scheduler: Scheduler, token_id: int = 5) -> tuple[int, int]:
    """One step; returns the ns spent in schedule() and in update()."""
    start = time.perf_counter_ns()
    output = scheduler.schedule()
    mid = time.perf_counter_ns()
    result = made_up_result(scheduler, output, token_id)
    before_update = time.perf_counter_ns()
    scheduler.update(output, result)
    end = time.perf_counter_ns()
    return mid - start, end - before_update


def measure(num_running: int, prefix_caching: bool, num_steps: int, repeats: int) -> Row:
    schedule_means, update_means = [], []
    cached = 0
    for _ in range(repeats):
        scheduler = build(num_running, prefix_caching, num_steps)
        times = [run_step(scheduler, token_id=5 + i % 100) for i in range(num_steps)]
        assert len(scheduler.running) == num_running, "a request finished or was preempted"
        schedule_means.append(statistics.fmean(t[0] for t in times) / 1e3)
        update_means.append(statistics.fmean(t[1] for t in times) / 1e3)
        cached = scheduler.stats().num_cached_blocks
    schedule_us, update_us = statistics.median(schedule_means), statistics.median(update_means)
    step_us = schedule_us + update_us
    return Row(
        num_running,
        prefix_caching,
        round(schedule_us, 1),
        round(update_us, 1),
        round(step_us / 1e3, 3),
        round(step_us / num_running, 2),
        cached,
    )


def to_markdown(rows: list[Row], header: str) -> str:
    base = {r.prefix_caching: r for r in rows if r.num_running == rows[0].num_running}
    same_n = {(r.num_running, r.prefix_caching): r for r in rows}
    lines = [
        header,
        "",
        "| running decodes | prefix caching | schedule() µs | update() µs | step ms "
        "| µs / request | per-request vs 16 | vs caching off |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        per_request = r.us_per_request / base[r.prefix_caching].us_per_request
        off = same_n.get((r.num_running, False))
        vs_off = f"{r.step_ms / off.step_ms:.2f}x" if off and r.prefix_caching else "–"
        lines.append(
            f"| {r.num_running} | {'on' if r.prefix_caching else 'off'} | "
            f"{r.schedule_us:.1f} | {r.update_us:.1f} | {r.step_ms:.3f} | "
            f"{r.us_per_request:.2f} | {per_request:.2f}x | {vs_off} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 256, 1024])
    parser.add_argument("--steps", type=int, default=160, help="timed steps per repeat")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    rows = []
    for num_running in args.sizes:
        for prefix_caching in (True, False):
            rows.append(measure(num_running, prefix_caching, args.steps, args.repeats))
            print(f"measured {rows[-1]}", file=sys.stderr)
    header = (
        f"Scheduler core, one step = schedule() + update() with N running decode requests "
        f"(block_size {BLOCK_SIZE}, {PROMPT_LEN}-token prompts sharing {SHARED_PREFIX_LEN}); "
        f"mean of {args.steps} steps, median of {args.repeats} runs; "
        f"Python {platform.python_version()}."
    )
    machine = machine_record()
    markdown = to_markdown(rows, f"{header}\n\n{machine_markdown(machine)}")
    print(markdown)
    results = REPO_ROOT / "bench" / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / "scheduler_core.md").write_text(markdown)
    (results / "scheduler_core.json").write_text(
        json.dumps(
            {
                "machine": machine,
                "steps": args.steps,
                "repeats": args.repeats,
                "rows": [asdict(r) for r in rows],
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
