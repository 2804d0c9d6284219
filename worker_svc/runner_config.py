"""A model runner's configuration and what it reports about itself: `RunnerConfig` (the
model folder, dtype, device, KV cache sizing, this rank's place in its engine group, CUDA
graphs, LoRA, a draft model; parsed once by the worker's main and passed down),
`RunnerInfo` (the model and KV cache facts the scheduler and router need) and `graph_sizes`
(the decode batch sizes a config captures as CUDA graphs)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protos.step import ImageTiling, PoolingInfo
from worker_svc.cuda_graphs import capture_sizes
from worker_svc.draft import DraftConfig
from worker_svc.kv_budget import DEFAULT_CPU_KV_CACHE_FRACTION, DEFAULT_GPU_MEMORY_UTILIZATION
from worker_svc.lora import LoraConfig
from worker_svc.parallel import ParallelConfig
from worker_svc.quant import QUANTIZATION_CHOICES


@dataclass(frozen=True)
class RunnerConfig:
    model_path: str
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "cpu"
    block_size: int = 16  # tokens per KV block
    # KV cache size per rank: `num_blocks` wins when set, else as many blocks as fit the
    # budget (a rank's blocks hold only its layers and KV heads); None sizes the budget from
    # the device (worker_svc/kv_budget.py) with the three settings after it.
    kv_cache_memory_bytes: int | None = None
    num_blocks: int | None = None
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    cpu_kv_cache_fraction: float = DEFAULT_CPU_KV_CACHE_FRACTION
    # The largest step the scheduler sends: the CUDA profiling pass runs one this big.
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    swap_space_bytes: int = 0  # CPU memory for preempted requests' KV; 0 = no swapping
    max_model_len: int | None = None  # tokens; default: the model's own limit
    attention_backend: str = "auto"  # auto | torch | triton
    cpu_linear: str = "auto"  # auto | native | onednn | torch: how linear layers multiply on CPU
    # auto | none | fp8 | awq; auto = what the checkpoint's config says (worker_svc/quant)
    quantization: str = "auto"
    # GGUF: keep the linear layers' quantized blocks, dequantize per matmul (quant/gguf.py)
    gguf_keep_quantized: bool = False
    parallel: ParallelConfig = ParallelConfig()  # this rank's place in its engine group
    # CUDA: capture decode steps as CUDA graphs at these batch sizes (None: 1, 2, 4, 8, 16,
    # ... up to max_num_seqs, worker_svc/cuda_graphs.py); vLLM's enforce_eager turns them off.
    enforce_eager: bool = False
    cuda_graph_sizes: tuple[int, ...] | None = None
    # CPU: while idle, fault in the KV cache's pages this many full steps (of
    # max_num_batched_tokens tokens) ahead of the blocks in use (worker_svc/kv_prefault.py)
    kv_prefault_steps: int = 8
    # Expert parallelism: rebalance the experts by their load every this many steps (0 =
    # never; worker_svc/model/expert_balance.py).
    eplb_interval_steps: int = 0
    # auto | generate | embed: sample tokens, or pool the prompt into one vector (vLLM's
    # --task / --runner; auto = what the folder says, worker_svc/model/pooling.py)
    task: str = "auto"
    # Multi-LoRA (worker_svc/lora/): adapters in one step, their rank limit, and how many
    # stay in memory; None = LoRA off.
    lora: LoraConfig | None = None
    # Draft-model speculative decoding (worker_svc/draft.py): loaded by the driver of the
    # last stage; None = no draft model.
    draft: DraftConfig | None = None

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory_bytes must be positive")
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(
                f"quantization must be one of {QUANTIZATION_CHOICES}, got {self.quantization!r}"
            )


@dataclass(frozen=True)
class RunnerInfo:
    """What the scheduler and router need to know about this worker's model."""

    model_name: str
    architecture: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_model_len: int  # tokens
    dtype: str  # "float32", "bfloat16", ...
    num_blocks: int  # this rank's; the group can use the minimum over its ranks
    num_swap_blocks: int
    block_size: int  # tokens per block
    num_layers: int  # the whole model's
    hidden_size: int
    num_kv_heads: int  # the whole model's
    head_dim: int
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    # none | fp8 | awq | gguf-<types> (e.g. gguf-q4_1): how the linear layers hold their weights
    quantization: str = "none"
    weight_bytes: int = 0  # this rank's weights in memory, quantized or packed as they are
    kv_cache_bytes: int = 0  # this rank's KV cache (num_blocks of its layers and heads)
    kv_cache_sizing: str = ""  # how its size was chosen (worker_svc/kv_budget.py)
    pooling: PoolingInfo = PoolingInfo()  # generate, or embed and how
    image_token_id: int = -1  # a vision-language model's image placeholder token, else -1
    image_seq_length: int = 0  # placeholders one image takes (0: a text model)
    image_tiling: ImageTiling = ImageTiling()  # LLaVA-NeXT: placeholders follow the size


def graph_sizes(config: RunnerConfig) -> tuple[int, ...]:
    """The decode batch sizes to capture as CUDA graphs; () for none (CPU, enforce_eager, and
    expert parallelism: its all-to-all sizes come from the step's routing, read on the
    host, which a graph cannot replay; LoRA, whose adapters per row change every step)."""
    if (
        config.enforce_eager
        or torch.device(config.device).type != "cuda"
        or config.parallel.expert_parallel
        or config.lora is not None
    ):
        return ()
    if config.cuda_graph_sizes is not None:
        return tuple(config.cuda_graph_sizes)
    return capture_sizes(config.max_num_seqs)
