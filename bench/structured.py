"""What structured output costs a decode step: 64 requests, each constrained to a JSON
schema, against the same 64 unconstrained, on the default model in-process.

    .venv/bin/python -m bench.structured                 # fp32, and bf16 where it is native
    .venv/bin/python -m bench.structured --steps 10 --dtypes float32

A ModelRunner on SmolLM2-135M-Instruct (the default model, GGUF dequantized) prefills two
batches of the same 64 chat prompts, one unconstrained and one with each request held to one
of four JSON schemas (llguidance masks, worker_svc/structured.py), then times greedy decode
steps of the two alternately, all 64 running in each. The cost is the median difference
between a constrained step and the plain step beside it. The mask's own computation (each
matcher catching up on the last token, the batch's bitmask) is timed too; it runs on its
own thread while the forward does, unless `--no-overlap` (computed at sampling time, as
before the overlap). A request whose JSON ends leaves the batch, as the scheduler would take
it out; the table gives the fewest constrained rows any timed step had. Grammars are
compiled as the router does (router/structured.py), whose cold and cached compile times are
reported too, as is the worker's matcher per request. Writes bench/results/structured.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager

NUM_REQUESTS = 64
SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": "string", "format": "email"},
            "tags": {"type": "array", "items": {"type": "string"}, "minItems": 3},
        },
        "required": ["name", "age", "email", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "minItems": 4,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                        "quantity": {"type": "integer", "minimum": 1},
                        "status": {"enum": ["pending", "shipped", "delivered"]},
                    },
                    "required": ["sku", "quantity", "status"],
                },
            }
        },
        "required": ["items"],
    },
    {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "forecast": {
                "type": "array",
                "minItems": 5,
                "items": {
                    "type": "object",
                    "properties": {
                        "day": {"enum": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]},
                        "high_c": {"type": "number"},
                        "low_c": {"type": "number"},
                    },
                    "required": ["day", "high_c", "low_c"],
                },
            },
        },
        "required": ["city", "forecast"],
    },
    {
        "type": "object",
        "properties": {
            "summary": {"type": "string", "minLength": 120},
            "sentiment": {"enum": ["positive", "neutral", "negative"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["summary", "sentiment", "confidence"],
    },
]
PROMPTS = [
    "Describe a person as JSON.",
    "List an order's items as JSON.",
    "Give this week's weather forecast as JSON.",
    "Summarize a product review as JSON.",
]


class MaskTimer:
    """Wall time the runner spends computing masks (each matcher catching up on the last
    token, the batch's masks computed by llguidance and unpacked), summed per step."""

    def __init__(self) -> None:
        self.seconds = 0.0

    @contextmanager
    def patched(self) -> Iterator[None]:
        from worker_svc import structured

        compute = structured.token_bitmask

        def timed(*args, **kwargs):  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            try:
                return compute(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        structured.token_bitmask = timed
        try:
            yield
        finally:
            structured.token_bitmask = compute


def _compute_masks_when_sampling() -> None:
    """PendingMasks that are computed at once, on the caller's thread."""
    from concurrent.futures import Future

    from worker_svc import structured

    def start(cls, vocabulary, rows):  # type: ignore[no-untyped-def]
        done: Future = Future()
        done.set_result(structured.token_bitmask(vocabulary, rows))
        return cls([c.row for c in rows], done)

    structured.PendingMasks.start = classmethod(start)  # type: ignore[method-assign]


def compile_grammars(
    tokenizer: object, vocab_size: int, eos_token_ids: list[int]
) -> tuple[list[str], float, float]:
    """The four schemas' grammars as the router makes them; cold and cached ms per schema
    (the vocabulary view, built once per model, is not in either)."""
    from pagemesh.api.options.constraint import OutputConstraint
    from router.structured import GrammarCompiler

    compiler = GrammarCompiler(tokenizer)  # type: ignore[arg-type]
    constraints = [OutputConstraint("json_schema", json.dumps(s)) for s in SCHEMAS]
    compiler.vocabulary(vocab_size, tuple(eos_token_ids))
    start = time.perf_counter()
    grammars = [compiler.compile(c, vocab_size, eos_token_ids) for c in constraints]
    cold_ms = 1000 * (time.perf_counter() - start) / len(constraints)
    start = time.perf_counter()
    for c in constraints:
        compiler.compile(c, vocab_size, eos_token_ids)
    cached_ms = 1000 * (time.perf_counter() - start) / len(constraints)
    return grammars, cold_ms, cached_ms


def measure(model: str, dtype: str, steps: int) -> dict:
    """Median decode ms/step unconstrained and constrained, the mask's part of the latter,
    the matchers' creation and the router's compile times."""
    from pagemesh.runtime.tokenizer import load_tokenizer
    from worker_svc.runner import ModelRunner
    from worker_svc.runner_config import RunnerConfig

    tokenizer = load_tokenizer(model)
    prompts = [
        tokenizer.apply_chat_template(PROMPTS[i % len(PROMPTS)]) for i in range(NUM_REQUESTS)
    ]
    blocks = (max(map(len, prompts)) + steps + 8) // 16 + 2
    runner = ModelRunner.from_config(
        RunnerConfig(model_path=model, dtype=dtype, num_blocks=NUM_REQUESTS * blocks * 2 + 8)
    )
    grammars, cold_ms, cached_ms = compile_grammars(
        tokenizer, runner.metadata.vocab_size, list(runner.metadata.eos_token_ids)
    )
    vocabulary = runner._grammar_vocabulary()
    vocabulary.tokenizer()  # built once per worker, at its first constrained request
    start = time.perf_counter()
    for i in range(NUM_REQUESTS):
        vocabulary.new_state(grammars[i % len(grammars)])
    matcher_ms = 1000 * (time.perf_counter() - start) / NUM_REQUESTS
    plain = Cohort(runner, "plain", prompts, [""] * NUM_REQUESTS, blocks, first_block=0)
    constrained = Cohort(
        runner,
        "json",
        prompts,
        [grammars[i % len(grammars)] for i in range(NUM_REQUESTS)],
        blocks,
        first_block=NUM_REQUESTS * blocks,
    )
    timer = MaskTimer()
    with timer.patched():
        # Alternate the two batches step by step, so that whatever else the machine does
        # falls on both alike; which goes first alternates too (the second of a pair ran
        # ~10% slower when the order was fixed).
        for step in range(steps + 3):
            if step % 2:
                plain.step(timed=step >= 3)
            timer.seconds = 0.0
            constrained.step(timed=step >= 3)
            if step >= 3:
                constrained.mask_ms.append(1000 * timer.seconds)
            if not step % 2:
                plain.step(timed=step >= 3)
    for cohort in (plain, constrained):
        cohort.finish()
    # Each constrained step against the plain step beside it: what the machine's speed
    # does meanwhile (it drifts by tens of percent here) falls out of the difference.
    paired = [c - p for p, c in zip(plain.step_ms, constrained.step_ms)]
    return {
        "dtype": dtype,
        "plain": plain.summary(),
        "constrained": constrained.summary(),
        "paired_difference_ms": _median(paired),
        "matcher_ms": matcher_ms,
        "compile_cold_ms": cold_ms,
        "compile_cached_ms": cached_ms,
    }


class Cohort:
    """64 requests prefilled together, then decoded one step at a time; a request that
    draws EOS (its JSON is complete) leaves, as the scheduler would take it out."""

    def __init__(
        self,
        runner: object,
        tag: str,
        prompts: list[list[int]],
        grammars: list[str],
        blocks: int,
        first_block: int,
    ) -> None:
        from protos.step import NewRequestData, SamplingParams, SchedulerOutput

        self.runner, self.tag = runner, tag
        self.eos = set(runner.metadata.eos_token_ids)  # type: ignore[attr-defined]
        new = [
            NewRequestData(
                f"{tag}{i}",
                prompts[i],
                len(prompts[i]),
                list(range(first_block + i * blocks, first_block + (i + 1) * blocks)),
                0,
                SamplingParams(temperature=0.0, seed=i, grammar=grammars[i]),
            )
            for i in range(len(prompts))
        ]
        out = runner.execute_step(
            SchedulerOutput(  # type: ignore[attr-defined]
                step_id=self._next_id(),
                new_requests=new,
                num_scheduled_tokens={r.request_id: len(r.token_ids) for r in new},
            )
        )
        self.sampled = dict(out.sampled)
        self.computed = {r.request_id: len(r.token_ids) for r in new}
        self.step_ms: list[float] = []
        self.mask_ms: list[float] = []
        self.fewest = len(new)

    _ids = iter(range(1_000_000))

    def _next_id(self) -> int:
        return next(Cohort._ids)

    def step(self, timed: bool) -> None:
        from protos.step import CachedRequestData, SchedulerOutput

        live = {r: s for r, s in self.sampled.items() if s.token_id not in self.eos}
        start = time.perf_counter()
        out = self.runner.execute_step(
            SchedulerOutput(  # type: ignore[attr-defined]
                step_id=self._next_id(),
                cached_requests=[
                    CachedRequestData(r, [], self.computed[r], [s.token_id])
                    for r, s in live.items()
                ],
                num_scheduled_tokens={r: 1 for r in live},
                finished_request_ids=[r for r in self.sampled if r not in live],
            )
        )
        if timed:
            self.step_ms.append(1000 * (time.perf_counter() - start))
            self.fewest = min(self.fewest, len(live))
        for r in live:
            self.computed[r] += 1
        self.sampled = dict(out.sampled)

    def finish(self) -> None:
        from protos.step import SchedulerOutput

        self.runner.execute_step(
            SchedulerOutput(  # type: ignore[attr-defined]
                step_id=self._next_id(), finished_request_ids=list(self.sampled)
            )
        )

    def summary(self) -> dict:
        return {
            "step_ms": _median(self.step_ms),
            "mask_ms": _median(self.mask_ms) if self.mask_ms else 0.0,
            "fewest_rows": self.fewest,
        }


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument(
        "--no-overlap",
        action="store_true",
        help="compute the masks when sampling, after the forward",
    )
    args = parser.parse_args()
    if args.no_overlap:
        _compute_masks_when_sampling()
    import torch

    from bench.common import write_results
    from kernels.cpu_features import cpu_features
    from pagemesh.runtime.models import default_model_path

    model = default_model_path()
    rows, data = [], {"runs": []}
    for dtype in args.dtypes.split(","):
        if dtype == "bfloat16" and cpu_features().why_bf16_is_slow():
            rows.append(
                [
                    dtype,
                    "—",
                    "—",
                    "—",
                    "—",
                    "—",
                    "—",
                    f"skipped: {cpu_features().why_bf16_is_slow()}",
                ]
            )
            continue
        result = measure(model, dtype, args.steps)
        plain, constrained = result["plain"], result["constrained"]
        data["runs"].append(result)
        overhead = result["paired_difference_ms"]
        rows.append(
            [
                dtype,
                f"{plain['step_ms']:.1f}",
                f"{constrained['step_ms']:.1f}",
                f"{overhead:+.1f} ({100 * overhead / plain['step_ms']:+.1f}%)",
                f"{constrained['mask_ms']:.2f} "
                f"({100 * constrained['mask_ms'] / plain['step_ms']:.1f}%)",
                f"{constrained['fewest_rows']} of {NUM_REQUESTS}",
                f"{result['matcher_ms']:.1f}",
                f"{result['compile_cold_ms']:.1f} / {result['compile_cached_ms']:.3f}",
            ]
        )
        print(rows[-1], flush=True)
    write_results(
        "structured-no-overlap" if args.no_overlap else "structured",
        f"Structured output's cost per decode step: SmolLM2-135M-Instruct in-process, "
        f"{NUM_REQUESTS} requests, greedy, median of {args.steps} steps, "
        f"{torch.get_num_threads()} threads, masks "
        f"{'computed when sampling' if args.no_overlap else 'computed during the forward'} "
        f"(`python -m bench.structured{' --no-overlap' if args.no_overlap else ''}`)",
        [
            "dtype",
            "plain step, ms",
            "constrained step, ms",
            "paired difference, ms (of plain)",
            "mask computed, ms (of plain)",
            "constrained rows (fewest)",
            "worker matcher per request, ms",
            "router compile per schema, ms cold / cached",
        ],
        rows,
        data,
    )


if __name__ == "__main__":
    main()
