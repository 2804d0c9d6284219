"""The model runner: one step in, one batch through the model, sampled tokens out.

It owns the model, the KV cache tensors and a copy of each running request's tokens and
block table. What runs next is the scheduler's decision; the runner validates a step,
applies it to its request state, and executes it.

`ModelRunner` is in three files: here its construction (loading this rank's shard, sizing
its KV cache), what it reports (`info`) and its entry point (`execute_step`); the step's
validation, group agreement and forward in runner_step.py (`StepExecutionMixin`, which says
how an engine group runs a step); sampling in runner_sampling.py (`SamplingMixin`). Its
config and report types are runner_config.py's.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from protos.step import ModelRunnerOutput, SchedulerOutput
from worker_svc.attention import AttentionBackend, get_attention_backend
from worker_svc.batch import BlockTables, RequestState, highest_block
from worker_svc.distributed import DistributedContext, checked_context
from worker_svc.draft import DraftModel, load_draft
from worker_svc.host_tier import HostTier
from worker_svc.kv_cache import (
    allocate_kv_caches,
    allocate_swap_caches,
    model_kv_spec,
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
from worker_svc.runner_config import RunnerConfig, RunnerInfo, graph_sizes
from worker_svc.runner_step import StepExecutionMixin
from worker_svc.structured import GrammarVocabulary

logger = logging.getLogger(__name__)

__all__ = ["ModelRunner"]


class ModelRunner(StepExecutionMixin):
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
            cuda_graph_sizes=graph_sizes(config),
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
