"""The model runner: one step in, one batch through the model, sampled tokens out.

It owns the model, the KV cache tensors and a copy of each running request's tokens and
block table. What runs next is the scheduler's decision; the runner validates a step,
applies it to its request state, and executes it.

In an engine group (tp_size x pp_size ranks) every rank runs every step, in step order,
and keeps the same request state. Before touching anything, the TP ranks of a stage
agree on a digest of the step; a later stage first receives the previous stage's hidden
states and residual (with that stage's digest) and compares. Each stage holds the KV
cache of its own layers and heads only. The last stage computes logits for the sampled
rows; only the driver (its tp rank 0) samples and returns tokens.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from protos.step import ImageTiling, ModelRunnerOutput, PoolingInfo, SampledToken, SchedulerOutput
from worker_svc import sampler
from worker_svc.attention import AttentionBackend, get_attention_backend
from worker_svc.batch import (
    BlockTables,
    RequestState,
    StepBatch,
    batch_order,
    build_batch,
    check_block_moves,
    highest_block,
    step_digest,
    validate_step,
)
from worker_svc.cuda_graphs import DecodeGraphs, capture_sizes, eager_reason
from worker_svc.distributed import (
    DistributedContext,
    StageMessage,
    StepMismatchError,
    UpstreamStageError,
    checked_context,
    format_digest,
)
from worker_svc.draft import DraftConfig, DraftModel, load_draft
from worker_svc.host_tier import HostTier
from worker_svc.kv_budget import (
    DEFAULT_CPU_KV_CACHE_FRACTION,
    DEFAULT_GPU_MEMORY_UTILIZATION,
)
from worker_svc.kv_cache import (
    allocate_kv_caches,
    allocate_swap_caches,
    model_kv_spec,
    move_blocks,
    num_blocks_for_budget,
)
from worker_svc.kv_prefault import KVPrefault
from worker_svc.kv_sizing import rank_kv_budget
from worker_svc.loader import ModelMetadata, load_model, open_source
from worker_svc.lora import LoraConfig
from worker_svc.lora.manager import LoraManager
from worker_svc.model.expert_balance import (
    ExpertBalancer,
    checkpoint_reader,
    expert_parallel_blocks,
)
from worker_svc.model.llama import LlamaForCausalLM
from worker_svc.model.matmul import pack_linear_weights, packed_weight_bytes
from worker_svc.model.pooling import Pooler
from worker_svc.multimodal import ImageEmbedder, llava_image_embedder
from worker_svc.parallel import ParallelConfig, global_rank
from worker_svc.quant import QUANTIZATION_CHOICES
from worker_svc.spec_verify import accept_drafts, check_drafts, sampling_rows
from worker_svc.structured import ConstrainedRow, GrammarVocabulary, PendingMasks

logger = logging.getLogger(__name__)

__all__ = ["ModelRunner", "RunnerConfig", "RunnerInfo", "RequestState", "validate_step"]


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


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        metadata: ModelMetadata,
        *,
        num_blocks: int,
        block_size: int,
        device: torch.device | str = "cpu",
        attention_backend: str = "auto",
        num_swap_blocks: int = 0,
        dist: DistributedContext | None = None,
        cpu_linear: str = "auto",
        kv_cache_sizing: str = "",
        cuda_graph_sizes: Sequence[int] = (),
        kv_prefault_blocks: int = 0,
        eplb_interval_steps: int = 0,
        image_embedder: ImageEmbedder | None = None,
        lora: LoraConfig | None = None,
        draft: DraftModel | None = None,
    ) -> None:
        self.model = model
        self.draft = draft
        # LoRA slots sized from the layers' weights, before packing leaves only their shapes.
        self.lora = LoraManager.from_config(model, lora) if lora is not None else None
        self.cpu_linear = pack_linear_weights(model, cpu_linear)
        self.metadata = metadata
        self.device = torch.device(device)
        self.parallel = model.parallel
        self.dist = dist or DistributedContext.single(self.device)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.backend: AttentionBackend = get_attention_backend(attention_backend, self.device)
        self.kv_spec = model_kv_spec(model, block_size, metadata.dtype)
        self.kv_caches = allocate_kv_caches(self.kv_spec, num_blocks, self.device)
        self.kv_cache_sizing = kv_cache_sizing or f"{num_blocks} blocks, as given"
        self.num_swap_blocks = num_swap_blocks
        self.swap_caches = allocate_swap_caches(self.kv_spec, num_swap_blocks, self.device)
        self.kv_prefault = (
            KVPrefault(self.kv_caches, num_blocks, kv_prefault_blocks).start()
            if kv_prefault_blocks > 0 and self.device.type == "cpu"
            else None
        )
        self.requests: dict[str, RequestState] = {}
        # The host tier (worker_svc/host_tier.py), set by the worker's main: blocks written
        # through to shared memory that outlives this process.
        self.host_tier: HostTier | None = None
        # An embedding model's head: pools its requests' rows instead of sampling.
        self.pooler = Pooler(metadata.pooling) if metadata.pooling.embeds else None
        # A vision-language model's first stage: images' embeddings for their placeholders.
        self.image_embedder = image_embedder
        self.block_tables = BlockTables()  # the requests' block ids, as the batch reads them
        self.grammar_vocabulary: GrammarVocabulary | None = None  # structured output
        self._sent_downstream = False  # this step's activations went to the next stage
        self.graphs = self._capture_graphs(cuda_graph_sizes) if cuda_graph_sizes else None
        self.expert_balancer = (
            ExpertBalancer(
                model,
                self.dist,
                checkpoint_reader(open_source(metadata.path).weights),
                eplb_interval_steps,
            )
            if eplb_interval_steps > 0 and expert_parallel_blocks(model)
            else None
        )

    @classmethod
    def from_config(
        cls, config: RunnerConfig, dist: DistributedContext | None = None
    ) -> ModelRunner:
        """Load this rank's shard of the model at `config.model_path` and size its KV cache.

        `dist` (from `init_distributed`) is required when `config.parallel` has more than
        one rank; it must be this rank's context.
        """
        dist = checked_context(config.parallel, config.device, dist)
        model, metadata = load_model(
            config.model_path,
            dtype=config.dtype,
            device=config.device,
            max_model_len=config.max_model_len,
            parallel=config.parallel,
            comm=dist,
            quantization=config.quantization,
            gguf_keep_quantized=config.gguf_keep_quantized,
            task=config.task,
        )
        spec = model_kv_spec(model, config.block_size, metadata.dtype)
        budget = rank_kv_budget(config, model, metadata, spec)
        draft = (
            load_draft(config.draft, config, metadata)
            if config.draft is not None
            and config.parallel.is_last_stage
            and config.parallel.is_driver
            else None
        )
        budget_bytes = budget.bytes
        if draft is not None and budget_bytes is not None:  # the draft's blocks share it
            draft_bytes = draft[1].bytes_per_block
            budget_bytes = (
                budget_bytes * spec.bytes_per_block // (spec.bytes_per_block + draft_bytes)
            )
        num_blocks = num_blocks_for_budget(spec, budget_bytes, config.num_blocks)
        logger.info(
            "KV cache: %d blocks of %d tokens (%d bytes each, %.2f GiB); %s",
            num_blocks,
            config.block_size,
            spec.bytes_per_block,
            num_blocks * spec.bytes_per_block / (1 << 30),
            budget.sizing,
        )
        num_swap_blocks = config.swap_space_bytes // spec.bytes_per_block
        return cls(
            model,
            metadata,
            num_blocks=num_blocks,
            block_size=config.block_size,
            device=config.device,
            attention_backend=config.attention_backend,
            num_swap_blocks=num_swap_blocks,
            dist=dist,
            cpu_linear=config.cpu_linear,
            kv_cache_sizing=budget.sizing,
            cuda_graph_sizes=_graph_sizes(config),
            kv_prefault_blocks=(
                config.kv_prefault_steps * config.max_num_batched_tokens // config.block_size
            ),
            eplb_interval_steps=config.eplb_interval_steps,
            lora=config.lora,
            draft=(
                DraftModel(
                    draft[0],
                    draft[1],
                    num_blocks,
                    get_attention_backend(config.attention_backend, config.device),
                    torch.device(config.device),
                    config.draft.num_drafts,
                    metadata.max_model_len,
                )
                if draft is not None and config.draft is not None
                else None
            ),
            image_embedder=(
                llava_image_embedder(metadata, config.device)
                if metadata.image_seq_length and config.parallel.is_first_stage
                else None
            ),
        )

    def reset_expert_placement(self) -> None:
        """After the group re-formed: experts back where a freshly loaded rank has them."""
        if self.expert_balancer is not None:
            self.expert_balancer.reset()

    def reset_requests(self) -> None:
        """Forget every request: a new scheduler session (or a re-formed group) re-sends each
        one in full. The KV cache stays as it is; the scheduler owns which blocks are used."""
        self.requests.clear()
        self.block_tables.clear()
        if self.pooler is not None:
            self.pooler.states.clear()

    def info(self) -> RunnerInfo:
        config = self.model.config
        return RunnerInfo(
            model_name=self.metadata.name,
            architecture=self.metadata.architecture,
            vocab_size=self.metadata.vocab_size,
            eos_token_ids=self.metadata.eos_token_ids,
            max_model_len=self.metadata.max_model_len,
            dtype=str(self.metadata.dtype).removeprefix("torch."),
            num_blocks=self.num_blocks,
            num_swap_blocks=self.num_swap_blocks,
            block_size=self.block_size,
            num_layers=config.num_layers,
            hidden_size=config.hidden_size,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            tp_rank=self.parallel.tp_rank,
            tp_size=self.parallel.tp_size,
            pp_rank=self.parallel.pp_rank,
            pp_size=self.parallel.pp_size,
            quantization=self.metadata.quantization,
            weight_bytes=packed_weight_bytes(self.model),
            kv_cache_bytes=self.num_blocks * self.kv_spec.bytes_per_block,
            kv_cache_sizing=self.kv_cache_sizing,
            pooling=self.metadata.pooling,
            image_token_id=self.metadata.image_token_id,
            image_seq_length=self.metadata.image_seq_length,
            image_tiling=self.metadata.image_tiling,
        )

    @torch.inference_mode()
    def execute_step(self, step: SchedulerOutput) -> ModelRunnerOutput:
        """Apply the step's request changes, run one forward over every scheduled token,
        and sample for each request whose known tokens are now all computed.

        Raises ValueError (and changes nothing) if the step does not fit the runner's state.
        In an engine group, also StepMismatchError when ranks got different steps, and
        UpstreamStageError when an earlier stage failed the step; no rank applies it then.
        Steps must arrive in step order; non-driver ranks return no tokens.
        """
        prefault = self.kv_prefault
        if prefault is None:
            return self._execute(step)
        prefault.step_started()  # its page faults wait while a step runs
        try:
            prefault.used_up_to(highest_block(step))
            return self._execute(step)
        finally:
            prefault.step_done()

    def _execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        if self.dist.is_single:
            self._validate(step)
            return self._run(step, None, digest=0)
        return self._execute_in_group(step)

    def _validate(self, step: SchedulerOutput) -> None:
        if step.append_sampled_tokens and not self.dist.is_single:
            raise ValueError(
                "append_sampled_tokens (async scheduling) needs an engine group "
                "of one rank: the other ranks would never learn the tokens"
            )
        validate_step(
            step,
            self.requests,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            max_model_len=self.metadata.max_model_len,
            vocab_size=self.metadata.vocab_size,
        )
        embeds = self.pooler is not None
        for new in step.new_requests:
            if new.images and self.image_embedder is None:
                raise ValueError(
                    f"request {new.request_id!r} carries images, but this model "
                    "takes none (a text-only model)"
                )
            if new.lora is not None and self.lora is None:
                raise ValueError(
                    f"request {new.request_id!r} names LoRA adapter "
                    f"{new.lora.name!r}, but LoRA is off on this worker"
                )
            if (new.pooling is not None) != embeds:
                raise ValueError(
                    f"request {new.request_id!r}: "
                    + (
                        "this model embeds (a pooling model): it samples no tokens"
                        if embeds
                        else "this model generates: start it with --task embed to embed"
                    )
                )
        check_block_moves(step, self.num_blocks, self.num_swap_blocks)
        check_drafts(step, self.requests)

    def _execute_in_group(self, step: SchedulerOutput) -> ModelRunnerOutput:
        digest = step_digest(step)
        self._sent_downstream = False
        inbound = None
        if not self.parallel.is_first_stage:
            # Receive before anything can fail, so the previous stage never blocks on us.
            inbound = self.dist.recv_stage_input(self.model.config.hidden_size, self.metadata.dtype)
        try:
            error: ValueError | None = None
            try:
                self._validate(step)
            except ValueError as exc:
                error = exc
            # Every TP rank reaches this collective whatever its step, so none can hang.
            self.dist.tp_agree(digest, ok=error is None)
            if error is not None:
                raise error
            if inbound is not None:
                self._check_inbound(inbound, step.step_id, digest)
            if self.expert_balancer is not None:  # the stage's ranks agree on the step
                self.expert_balancer.maybe_rebalance(step.step_id)
            return self._run(step, inbound, digest)
        except Exception:
            self._report_failure_downstream(step.step_id, digest)
            raise

    def _check_inbound(self, inbound: StageMessage, step_id: int, digest: int) -> None:
        parallel = self.parallel
        upstream = global_rank(parallel, parallel.pp_rank - 1, parallel.tp_rank)
        if inbound.failed:
            raise UpstreamStageError(
                f"rank {upstream} (stage {parallel.pp_rank - 1}) failed step {inbound.step_id}; "
                f"rank {parallel.rank} (stage {parallel.pp_rank}) skips step {step_id}"
            )
        if inbound.digest != digest or inbound.step_id != step_id:
            raise StepMismatchError(
                f"rank {upstream} (stage {parallel.pp_rank - 1}) ran step {inbound.step_id} "
                f"(digest {format_digest(inbound.digest)}) but rank {parallel.rank} (stage "
                f"{parallel.pp_rank}) got step {step_id} (digest {format_digest(digest)})"
            )

    def _report_failure_downstream(self, step_id: int, digest: int) -> None:
        """The next stage waits for this step's message: tell it the step failed here."""
        if self.parallel.is_last_stage or self._sent_downstream:
            return
        self._sent_downstream = True
        try:
            self.dist.send_stage_failure(step_id, digest)
        except Exception:  # the original error is the one worth raising
            logger.exception("could not tell the next stage that step %d failed", step_id)

    def _send_downstream(
        self, step_id: int, digest: int, hidden: torch.Tensor | None, residual: torch.Tensor | None
    ) -> None:
        self._sent_downstream = True
        self.dist.send_stage_output(step_id, digest, hidden, residual)

    def _run(
        self, step: SchedulerOutput, inbound: StageMessage | None, digest: int
    ) -> ModelRunnerOutput:
        """Execute a validated (and, in a group, agreed) step on this rank."""
        move_blocks(self.kv_caches, self.swap_caches, step.blocks_to_swap_out)
        move_blocks(self.swap_caches, self.kv_caches, step.blocks_to_swap_in)
        move_blocks(self.kv_caches, self.kv_caches, step.blocks_to_copy)
        if step.blocks_to_offload and self.host_tier is not None:  # before the forward
            self.host_tier.store(self.kv_caches, step.blocks_to_offload)
        if self.draft is not None:
            self.draft.copy_blocks(step.blocks_to_copy)
        self._update_states(step)
        if not step.num_scheduled_tokens:
            if not self.parallel.is_last_stage:
                self._send_downstream(step.step_id, digest, None, None)
            return ModelRunnerOutput(step_id=step.step_id)
        start_s = time.perf_counter()
        batch = build_batch(
            self.requests,
            step.num_scheduled_tokens,
            self.block_size,
            self.device,
            self.block_tables,
        )
        intermediate = None if inbound is None else (inbound.hidden, inbound.residual)
        samples_here = self.parallel.is_last_stage and self.parallel.is_driver and batch.sample_rows
        masks = self._start_masks(batch.sample_request_ids) if samples_here else None
        try:
            hidden, residual = self._forward(batch, step.num_scheduled_tokens, intermediate)
            if self.draft is not None:
                self.draft.follow(batch)
            sampled: dict[str, SampledToken] = {}
            spec_sampled: dict[str, list[SampledToken]] = {}
            pooled: dict[str, bytes] = {}
            drafts: dict[str, list[int]] = {}
            if not self.parallel.is_last_stage:
                self._send_downstream(step.step_id, digest, hidden, residual)
            elif batch.pool_segments:
                if self.parallel.is_driver:
                    pooled = self.pooler.pool(
                        lambda rows: self.model.final_hidden(hidden[rows], residual[rows]),
                        batch.pool_segments,
                    )
            elif batch.sample_rows:
                rows = torch.tensor(batch.sample_rows, device=self.device)
                # Every TP rank of the last stage joins the LM head's all-gather.
                logits = self.model.compute_logits(hidden[rows], residual[rows])
                if self.parallel.is_driver:
                    sampled, spec_sampled = self._sample(logits, batch.sample_request_ids, masks)
                    if self.draft is not None:
                        drafts = self.draft.propose(
                            self.requests, self.block_tables, sampled, spec_sampled
                        )
                    if step.append_sampled_tokens:
                        for request_id, token in sampled.items():
                            self.requests[request_id].token_ids.append(token.token_id)
        finally:
            if masks is not None:
                masks.settle()
        for request_id, num_tokens in step.num_scheduled_tokens.items():
            state = self.requests[request_id]
            state.num_computed_tokens += num_tokens  # drafts too: the scheduler rolls back
            state.draft_token_ids = []
        forward_time_ms = (time.perf_counter() - start_s) * 1000.0
        return ModelRunnerOutput(
            step_id=step.step_id,
            sampled=sampled,
            spec_sampled=spec_sampled,
            forward_time_ms=forward_time_ms,
            pooled=pooled,
            draft_token_ids=drafts,
        )

    def _forward(
        self,
        batch: StepBatch,
        num_scheduled_tokens: dict[str, int],
        intermediate: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The model over the batch: a CUDA graph's replay for a decode step that fits one,
        else eagerly."""
        if (
            self.graphs is not None
            and eager_reason(
                num_scheduled_tokens, self.graphs.sizes, later_stage=intermediate is not None
            )
            is None
        ):
            return self.graphs.run(batch.input_ids, batch.positions, batch.metadata)
        overrides = None
        if self.image_embedder is not None and intermediate is None:
            overrides = self.image_embedder.overrides(batch.image_segments, self.device)
        if self.lora is None:
            return self.model(
                batch.input_ids,
                batch.positions,
                self.kv_caches,
                batch.metadata,
                self.backend,
                intermediate,
                overrides,
            )
        order = batch_order(num_scheduled_tokens)
        self.lora.row_slots(
            self.lora.prepare([self.requests[r].lora for r in order]),
            np.fromiter((num_scheduled_tokens[r] for r in order), np.int64),
        )
        try:
            return self.model(
                batch.input_ids,
                batch.positions,
                self.kv_caches,
                batch.metadata,
                self.backend,
                intermediate,
                overrides,
            )
        finally:
            self.lora.row_slots(None, np.empty(0, np.int64))

    @torch.inference_mode()
    def _capture_graphs(self, sizes: Sequence[int]) -> DecodeGraphs | None:
        """Decode graphs over this runner's KV cache (allocated by now), or None (and why)
        where they cannot be: not CUDA, or an attention backend that reads lengths on the host."""
        fix_plan = getattr(self.backend, "fix_decode_plan", None)
        if self.device.type != "cuda" or fix_plan is None:
            logger.info(
                "CUDA graphs off: %s",
                "not a CUDA device"
                if self.device.type != "cuda"
                else f"the {self.backend.name} attention backend cannot be captured",
            )
            return None
        max_len = self.metadata.max_model_len
        graphs = DecodeGraphs(
            lambda ids, positions, metadata: self.model(
                ids, positions, self.kv_caches, metadata, self.backend, None
            ),
            lambda metadata, size: fix_plan(metadata, size, max_len),
            sizes,
            max_blocks_per_seq=-(-max_len // self.block_size),
            device=self.device,
        )
        graphs.capture()
        return graphs

    def _update_states(self, step: SchedulerOutput) -> None:
        for request_id in step.finished_request_ids:
            self.requests.pop(request_id, None)
            self.block_tables.remove(request_id)
            if self.pooler is not None:
                self.pooler.forget(request_id)
        for new in step.new_requests:
            # Sent in full: replaces any state kept under the same id (a rebuild).
            self.requests[new.request_id] = RequestState(
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                sampling=new.sampling,
                pooling=new.pooling,
                images=new.images,
                lora=new.lora,
            )
            self.block_tables.set(new.request_id, new.block_ids)
        for cached in step.cached_requests:
            state = self.requests[cached.request_id]
            state.token_ids.extend(cached.new_token_ids)
            state.block_ids.extend(cached.new_block_ids)
            self.block_tables.extend(cached.request_id, cached.new_block_ids)
            # The scheduler's count is authoritative (it may have rolled back on preemption,
            # or past rejected drafts).
            state.num_computed_tokens = cached.num_computed_tokens
            state.draft_token_ids = list(cached.spec_token_ids)

    def _start_masks(self, request_ids: list[str]) -> PendingMasks | None:
        """The constrained rows' masks, started on the mask thread so that they are computed
        while the forward runs; None when no row is constrained."""
        constrained: list[ConstrainedRow] = []
        for row, request_id in enumerate(request_ids):
            if row and request_ids[row - 1] == request_id:
                continue  # a draft's row: its mask comes with its request's first row
            state = self.requests[request_id]
            if state.sampling.grammar:
                if state.grammar is None:
                    state.grammar = self._grammar_vocabulary().new_state(state.sampling.grammar)
                constrained.append(
                    ConstrainedRow(
                        row,
                        state.grammar,
                        state.token_ids[state.num_prompt_tokens :],
                        state.draft_token_ids,
                    )
                )
        return PendingMasks.start(self._grammar_vocabulary(), constrained) if constrained else None

    def _sample(
        self, logits: torch.Tensor, request_ids: list[str], pending: PendingMasks | None
    ) -> tuple[dict[str, SampledToken], dict[str, list[SampledToken]]]:
        """Each request's token, and the tokens of its accepted drafts (spec_verify.py)."""
        masks = None if pending is None else sampler.RowMasks(pending.rows, pending.bits.result())
        tokens = sampler.sample(logits, sampling_rows(self.requests, request_ids), masks)
        return accept_drafts(self.requests, request_ids, tokens)

    def _grammar_vocabulary(self) -> GrammarVocabulary:
        """Made at the first constrained request (structured output is opt-in per request)."""
        if self.grammar_vocabulary is None:
            self.grammar_vocabulary = GrammarVocabulary(
                self.metadata.path, self.metadata.vocab_size, self.metadata.eos_token_ids
            )
        return self.grammar_vocabulary


def _graph_sizes(config: RunnerConfig) -> tuple[int, ...]:
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
