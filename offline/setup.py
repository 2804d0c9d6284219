"""How the offline `LLM` checks what it was asked to serve, then builds its engine: the
model runner(s) sized as `pagemesh up` sizes its workers, the scheduler core sized from
what they report (as scheduler_svc/main.py does), the engine loop on its thread.

`check_servable` reads only the checkpoint's config and the tokenizer, so a missing path,
an architecture the loader does not know, or a tensor-parallel size the heads do not
divide fails at once, before any weight is read or any memory is set aside.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from offline.diagnostics import RankAdmin
from offline.engine import EngineCore
from pagemesh.api.options.validation import ModelLimits
from pagemesh.runtime.speculative_config import SpeculativeConfig
from pagemesh.runtime.tokenizer import Tokenizer, load_tokenizer
from protos.step import LoraRef
from router.structured import GrammarCompiler
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.policy import POLICIES
from scheduler_svc.core.scheduler import Scheduler
from worker_svc.draft import draft_config
from worker_svc.lora import LoraConfig
from worker_svc.runner_config import RunnerConfig, RunnerInfo

GIB = 1 << 30
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
DEVICE_CHOICES = ("auto", "cpu", "cuda")
CPU_KV_CACHE_FRACTION = 0.4  # of the host's available memory, shared by the ranks


@dataclass(frozen=True)
class EngineSetup:
    """What the LLM was asked for (units: GiB for memory, tokens for lengths)."""

    model: str | None
    tokenizer: str | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enable_expert_parallel: bool = False  # MoE: whole experts per TP rank
    dtype: str = "auto"
    max_model_len: int | None = None
    kv_cache_memory_gib: float | None = None
    swap_space_gib: float = 4.0
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    scheduling_policy: str = "fcfs"
    device: str = "auto"
    task: str = "auto"  # auto | generate | embed (worker_svc/model/pooling.py)
    lora: LoraConfig | None = None  # multi-LoRA; None = off
    speculative: SpeculativeConfig | None = None  # speculative decoding; None = off

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class CheckedSetup:
    model_path: str
    device: str  # "cpu" or "cuda"
    tokenizer: Tokenizer


@dataclass
class BuiltEngine:
    engine: EngineCore
    tokenizer: Tokenizer
    info: RunnerInfo  # the driver rank's
    limits: ModelLimits
    num_kv_blocks: int
    grammars: GrammarCompiler
    ranks: RankAdmin  # the ranks' diagnostics: the executor
    num_swap_blocks: int  # the scheduler's swap space, blocks
    workers: Any = None  # LocalWorkers for more than one rank
    # Reads and fits a LoRA adapter to the model (raises ValueError); None: LoRA off.
    load_lora: Callable[[LoraRef], object] | None = None


def check_servable(setup: EngineSetup) -> CheckedSetup:
    """Raises FileNotFoundError (no such model) or ValueError (what cannot be served, and
    why) having read only configs and the tokenizer."""
    _check_numbers(setup)
    if setup.model is None:
        from pagemesh.runtime.models import default_model_path

        model_path = default_model_path()
    else:
        model_path = str(Path(os.path.expanduser(setup.model)))
        if not Path(model_path).exists():
            raise FileNotFoundError(
                f"model path {model_path} does not exist; pass a Hugging "
                "Face model folder or a .gguf file"
            )
    device = _device(setup)
    import torch  # noqa: F401  (the loader's imports)

    from worker_svc.encoder_runner import is_encoder_model
    from worker_svc.loader import open_source
    from worker_svc.model.parallel_layers import check_tensor_parallel

    if is_encoder_model(model_path):  # CLIP: one rank, its own runner
        if setup.world_size > 1:
            raise ValueError(
                f"cannot serve {model_path}: a CLIP model runs on one rank "
                "(tensor_parallel_size = pipeline_parallel_size = 1)"
            )
        return CheckedSetup(model_path, device, load_tokenizer(setup.tokenizer or model_path))
    from worker_svc.parallel import ParallelConfig
    from worker_svc.quant.config import resolve_quantization

    try:
        source = open_source(model_path)
    except FileNotFoundError:
        raise
    except (ValueError, KeyError, OSError) as exc:
        raise ValueError(f"cannot serve {model_path}: {exc}") from exc
    try:
        resolve_quantization("auto", source.quantization_config)
    except ValueError as exc:
        raise ValueError(f"cannot serve {model_path}: {exc}") from exc
    limit = source.config.max_position_embeddings
    if setup.max_model_len is not None and setup.max_model_len > limit:
        raise ValueError(
            f"max_model_len={setup.max_model_len} must be in 1..{limit} (the "
            "model's max_position_embeddings / context_length)"
        )
    check_tensor_parallel(source.config, setup.tensor_parallel_size, setup.enable_expert_parallel)
    ParallelConfig(setup.tensor_parallel_size, 0, setup.pipeline_parallel_size, 0).layer_range(
        source.config.num_layers
    )
    tokenizer = load_tokenizer(setup.tokenizer or model_path)  # TokenizerError: a ValueError
    return CheckedSetup(model_path, device, tokenizer)


def _check_numbers(setup: EngineSetup) -> None:
    for name in (
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "max_num_seqs",
        "max_num_batched_tokens",
        "block_size",
    ):
        value = getattr(setup, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if setup.max_model_len is not None and setup.max_model_len < 1:
        raise ValueError(f"max_model_len must be >= 1 (tokens), got {setup.max_model_len}")
    if setup.kv_cache_memory_gib is not None and not setup.kv_cache_memory_gib > 0:
        raise ValueError(f"kv_cache_memory_gib must be > 0, got {setup.kv_cache_memory_gib}")
    if not setup.swap_space_gib >= 0:
        raise ValueError(f"swap_space must be >= 0 (GiB), got {setup.swap_space_gib}")
    if not 0 < setup.gpu_memory_utilization <= 1:
        raise ValueError(
            f"gpu_memory_utilization must be in (0, 1], got {setup.gpu_memory_utilization}"
        )
    if setup.dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {setup.dtype!r}")
    if setup.scheduling_policy not in POLICIES:
        raise ValueError(
            f"scheduling_policy must be one of {', '.join(POLICIES)}, "
            f"got {setup.scheduling_policy!r}"
        )
    if setup.device not in DEVICE_CHOICES:
        raise ValueError(f"device must be one of {', '.join(DEVICE_CHOICES)}, got {setup.device!r}")


def _device(setup: EngineSetup) -> str:
    import torch

    device = setup.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        available = torch.cuda.device_count()
        if available < setup.world_size:
            raise ValueError(
                f"{setup.world_size} ranks need as many GPUs; this machine has {available}"
            )
    return device


def build_engine(setup: EngineSetup, checked: CheckedSetup) -> BuiltEngine:
    """Loads the model (one rank here, or one process per rank) and starts the engine."""
    from kernels import cpu_native
    from offline.diagnostics import DiagnosedInprocExecutor, RankDiagnostics
    from scheduler_svc.executor import model_thread
    from worker_svc.encoder_runner import load_runner
    from worker_svc.parallel import ParallelConfig

    cpu_native.configure(cpu_native.native_kernel_config_from_env(os.environ))
    world_size = setup.world_size
    config = RunnerConfig(
        model_path=checked.model_path,
        dtype=setup.dtype,
        device=checked.device,
        block_size=setup.block_size,
        kv_cache_memory_bytes=(
            None if setup.kv_cache_memory_gib is None else int(setup.kv_cache_memory_gib * GIB)
        ),
        gpu_memory_utilization=setup.gpu_memory_utilization,
        cpu_kv_cache_fraction=CPU_KV_CACHE_FRACTION / world_size,
        max_num_batched_tokens=setup.max_num_batched_tokens,
        max_num_seqs=setup.max_num_seqs,
        swap_space_bytes=int(setup.swap_space_gib * GIB),
        max_model_len=setup.max_model_len,
        parallel=ParallelConfig(
            setup.tensor_parallel_size,
            0,
            setup.pipeline_parallel_size,
            0,
            expert_parallel=setup.enable_expert_parallel,
        ),
        task=setup.task,
        lora=setup.lora,
        draft=draft_config(setup.speculative),
    )
    workers = None
    load_lora = None
    if world_size == 1:
        thread = model_thread()  # loads here and steps here: one OpenMP team
        runner = thread.submit(load_runner, config).result()
        infos = [runner.info()]
        lead = infos[0]
        executor: Any = DiagnosedInprocExecutor(RankDiagnostics(runner), thread)
        lora = getattr(runner, "lora", None)  # an encoder (CLIP) runner has none
        if lora is not None:
            load_lora = lambda ref: thread.submit(lora.load, ref).result()  # noqa: E731
    else:
        from offline.local_workers import LocalWorkers, LocalWorkersExecutor, default_num_threads

        num_threads = default_num_threads(world_size) if checked.device == "cpu" else 0
        workers = LocalWorkers(config, num_threads)
        infos = workers.infos
        lead = infos[workers.driver_rank]
        executor = LocalWorkersExecutor(workers)
        if setup.lora is not None:  # every rank reads it and checks its shard's shapes
            load_lora = lambda ref: executor.call("load_lora", ref)  # noqa: E731
    scheduler_config = SchedulerConfig(
        num_blocks=min(info.num_blocks for info in infos),
        block_size=lead.block_size,
        max_num_batched_tokens=setup.max_num_batched_tokens,
        max_num_seqs=setup.max_num_seqs,
        max_model_len=lead.max_model_len,
        enable_prefix_caching=setup.enable_prefix_caching,
        policy=setup.scheduling_policy,
        num_swap_blocks=min(info.num_swap_blocks for info in infos),
        num_microbatches=setup.pipeline_parallel_size,
        # Only a lone rank fills in its own tokens; and not while speculating (a step
        # planned ahead assumes one token).
        async_scheduling=world_size == 1 and setup.speculative is None,
        pooling=lead.pooling,
        max_loras=setup.lora.max_loras if setup.lora is not None else 0,
        speculative=setup.speculative,
    )
    engine = EngineCore(
        Scheduler(scheduler_config), executor, max_steps_in_flight=setup.pipeline_parallel_size
    )
    limits = ModelLimits(
        name=lead.model_name,
        max_model_len=lead.max_model_len,
        vocab_size=lead.vocab_size,
        eos_token_ids=list(lead.eos_token_ids),
    )
    return BuiltEngine(
        engine,
        checked.tokenizer,
        lead,
        limits,
        scheduler_config.num_blocks,
        GrammarCompiler(checked.tokenizer),
        executor,
        scheduler_config.num_swap_blocks,
        workers,
        load_lora,
    )
