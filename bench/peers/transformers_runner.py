"""Hugging Face transformers as a peer of `pagemesh bench`: the plain `generate` loop that
everyone has, one request at a time and in static batches, greedy with EOS ignored.

Runs in the project venv (transformers and torch are pagemesh dependencies), either called
directly (`run_transformers`, what the tests do) or as a subprocess through the CLI at the
bottom (what `suite.run_peers` does, so each dtype gets a fresh process and a timeout).

Timing. `generate` hands each decoding step's tokens to a streamer the moment they reach the
host; `_TimingStreamer` stamps those moments, which is what a streaming client would see:
TTFT is the first stamp minus the call's start, ITL the gaps between stamps. A static batch
stamps all its requests at once, so they share TTFT/ITL/e2e, measured from the batch's start
(a request of the 3rd batch does not count the time it waited for batches 1-2). The idle TTFT
is the duration of a 1-token `generate` on an otherwise idle process, median of 5.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from pagemesh.tools.loadgen.result import RunResult  # noqa: E402

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
NUM_IDLE_TTFT_SAMPLES = 5


@dataclass
class TransformersRun:
    """results: one RunResult per mode plus the idle-TTFT one; token_ids: mode
    ("sequential" / "batched") -> the new tokens of each prompt, in prompt order."""

    results: list[RunResult]
    token_ids: dict[str, list[list[int]]]

    def to_json(self) -> dict:
        return {"results": [r.to_json() for r in self.results], "token_ids": self.token_ids}


class _TimingStreamer:
    """A `generate` streamer that keeps only arrival times: the first `put` is the prompt,
    every later one is a decoding step's tokens (for the whole batch)."""

    def __init__(self) -> None:
        self.times_s: list[float] = []
        self._seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if self._seen_prompt:
            self.times_s.append(time.perf_counter())
        self._seen_prompt = True

    def end(self) -> None:
        pass


@dataclass
class _Timed:
    """One `generate` call: new tokens per prompt and its timings in milliseconds."""

    token_ids: list[list[int]]
    ttft_ms: float
    itl_ms: list[float]
    e2e_ms: float


def load_model(model_dir: str | Path, dtype: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=TORCH_DTYPES[dtype])
    return model.eval()


@torch.inference_mode()
def generate_greedy(model: torch.nn.Module, batch: list[list[int]], max_tokens: int) -> _Timed:
    """Greedy decoding of exactly `max_tokens` new tokens for each prompt of `batch`, left
    padded (the only padding side that keeps every row's last position the newest token)."""
    from transformers import GenerationConfig

    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    width = max(len(p) for p in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, prompt in enumerate(batch):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    # A fresh config so the folder's generation_config.json cannot turn sampling back on;
    # min_new_tokens = max_new_tokens suppresses EOS, as `ignore_eos` does for vLLM.
    config = GenerationConfig(
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        do_sample=False,
        num_beams=1,
        pad_token_id=pad_id,
        eos_token_id=model.config.eos_token_id,
    )
    streamer = _TimingStreamer()
    start = time.perf_counter()
    output = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        generation_config=config,
        streamer=streamer,
    )
    end = time.perf_counter()
    stamps = streamer.times_s
    return _Timed(
        token_ids=output[:, width:].tolist(),
        ttft_ms=1000 * (stamps[0] - start),
        itl_ms=[1000 * (b - a) for a, b in zip(stamps, stamps[1:])],
        e2e_ms=1000 * (end - start),
    )


def _run_batches(
    model: torch.nn.Module, prompts: list[list[int]], max_tokens: int, batch_size: int
) -> tuple[list[_Timed], list[list[int]], float]:
    """Static batches of `batch_size` in prompt order: (one _Timed per request, tokens, wall s)."""
    per_request: list[_Timed] = []
    tokens: list[list[int]] = []
    start = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        batch = prompts[first : first + batch_size]
        timed = generate_greedy(model, batch, max_tokens)
        per_request += [timed] * len(batch)
        tokens += timed.token_ids
    return per_request, tokens, time.perf_counter() - start


def _result(
    engine: str,
    workload: str,
    dtype: str,
    concurrency: int,
    prompts: list[list[int]],
    tokens: list[list[int]],
    timed: list[_Timed],
    duration_s: float,
    notes: str,
) -> RunResult:
    return RunResult(
        engine=engine,
        workload=workload,
        dtype=dtype,
        concurrency=concurrency,
        num_requests=len(prompts),
        prompt_tokens=sum(len(p) for p in prompts),
        output_tokens=sum(len(t) for t in tokens),
        duration_s=duration_s,
        ttft_ms=[t.ttft_ms for t in timed],
        itl_ms=[g for t in timed for g in t.itl_ms],
        e2e_ms=[t.e2e_ms for t in timed],
        notes=notes,
    )


def measure_idle_ttft(
    model: torch.nn.Module, prompts: list[list[int]], workload: str, dtype: str, engine: str
) -> RunResult:
    """TTFT of one request on an idle engine: a 1-token generate, NUM_IDLE_TTFT_SAMPLES times."""
    samples = [
        generate_greedy(model, [prompts[i % len(prompts)]], 1) for i in range(NUM_IDLE_TTFT_SAMPLES)
    ]
    ttft = [s.e2e_ms for s in samples]
    used = [prompts[i % len(prompts)] for i in range(NUM_IDLE_TTFT_SAMPLES)]
    return RunResult(
        engine=engine,
        workload=f"{workload}-idle-ttft",
        dtype=dtype,
        concurrency=1,
        num_requests=len(samples),
        prompt_tokens=sum(len(p) for p in used),
        output_tokens=len(samples),
        duration_s=sum(ttft) / 1000,
        ttft_ms=ttft,
        e2e_ms=ttft,
        notes=f"1-token generate on an idle process; median {statistics.median(ttft):.1f} ms",
    )


def run_transformers(
    model_dir: str | Path,
    prompts: list[list[int]],
    max_tokens: int,
    dtype: str = "float32",
    *,
    batch_size: int = 16,
    modes: tuple[str, ...] = ("sequential", "batched"),
    num_sequential: int | None = None,
    workload: str = "w64",
    num_threads: int | None = None,
) -> TransformersRun:
    """Measure transformers on `prompts`: "sequential" (one request at a time, the first
    `num_sequential` prompts or all), "batched" (static batches of `batch_size`), then the idle
    TTFT. Greedy, EOS ignored, every request gets exactly `max_tokens` new tokens."""
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {sorted(TORCH_DTYPES)}")
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    model = load_model(model_dir, dtype)
    # Warm-up: the first call of each shape pays for oneDNN primitive creation.
    generate_greedy(model, [p[:8] for p in prompts[:2]], 2)
    generate_greedy(model, [prompts[0][:8]], 2)
    label = f"transformers {dtype}"
    results: list[RunResult] = []
    token_ids: dict[str, list[list[int]]] = {}
    if "sequential" in modes:
        chosen = prompts[:num_sequential] if num_sequential else prompts
        timed, tokens, wall_s = _run_batches(model, chosen, max_tokens, 1)
        results.append(
            _result(
                f"{label} one at a time",
                workload,
                dtype,
                1,
                chosen,
                tokens,
                timed,
                wall_s,
                "sequential generate, streamer-timed",
            )
        )
        token_ids["sequential"] = tokens
    if "batched" in modes:
        timed, tokens, wall_s = _run_batches(model, prompts, max_tokens, batch_size)
        results.append(
            _result(
                f"{label} static batch {batch_size}",
                workload,
                dtype,
                batch_size,
                prompts,
                tokens,
                timed,
                wall_s,
                f"static batches of {batch_size}, left padded; TTFT/ITL/e2e per batch",
            )
        )
        token_ids["batched"] = tokens
    results.append(measure_idle_ttft(model, prompts, workload, dtype, f"{label} idle TTFT"))
    return TransformersRun(results, token_ids)


def main(argv: list[str] | None = None) -> None:
    """`python -m bench.peers.transformers_runner --model DIR --prompts FILE --dtype D`:
    FILE is JSON {"prompts": [[ids]], "max_tokens": N}; prints TransformersRun JSON (or
    writes it to --out)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True, help="JSON {prompts, max_tokens}")
    parser.add_argument("--dtype", default="float32", choices=sorted(TORCH_DTYPES))
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--modes", default="sequential,batched")
    parser.add_argument("--num-sequential", type=int, default=None)
    parser.add_argument("--workload", default="w64")
    parser.add_argument("--out", default=None, help="write the JSON here instead of stdout")
    args = parser.parse_args(argv)
    spec = json.loads(Path(args.prompts).read_text())
    run = run_transformers(
        args.model,
        spec["prompts"],
        spec["max_tokens"],
        args.dtype,
        batch_size=args.batch_size,
        modes=tuple(args.modes.split(",")),
        num_sequential=args.num_sequential,
        workload=args.workload,
    )
    text = json.dumps(run.to_json())
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
