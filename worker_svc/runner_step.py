"""Step execution, a part of `ModelRunner` (runner.py): validate a step against the runner's
request state, agree on it across the engine group, apply its block moves and request
changes, run the forward (a CUDA graph's replay where one fits), then hand the activations
to the next stage, or pool or sample on the last one (runner_sampling.py).

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

import numpy as np
import torch

from protos.step import ModelRunnerOutput, SampledToken, SchedulerOutput
from worker_svc.attention import AttentionBackend
from worker_svc.batch import (
    BlockTables,
    RequestState,
    StepBatch,
    batch_order,
    build_batch,
    check_block_moves,
    step_digest,
    validate_step,
)
from worker_svc.cuda_graphs import DecodeGraphs, eager_reason
from worker_svc.distributed import (
    DistributedContext,
    StageMessage,
    StepMismatchError,
    UpstreamStageError,
    format_digest,
)
from worker_svc.draft import DraftModel
from worker_svc.host_tier import HostTier
from worker_svc.kv_cache import move_blocks
from worker_svc.lora.manager import LoraManager
from worker_svc.model.expert_balance import ExpertBalancer
from worker_svc.model.llama import LlamaForCausalLM
from worker_svc.model.pooling import Pooler
from worker_svc.multimodal import ImageEmbedder
from worker_svc.parallel import ParallelConfig, global_rank
from worker_svc.runner_sampling import SamplingMixin
from worker_svc.spec_verify import check_drafts

logger = logging.getLogger(__name__)


class StepExecutionMixin(SamplingMixin):
    """`ModelRunner`'s step execution; its constructor sets the state below."""

    model: LlamaForCausalLM
    draft: DraftModel | None
    lora: LoraManager | None
    device: torch.device
    parallel: ParallelConfig
    dist: DistributedContext
    block_size: int  # tokens per KV block
    num_blocks: int
    num_swap_blocks: int
    backend: AttentionBackend
    kv_caches: list[torch.Tensor]
    swap_caches: list[torch.Tensor]
    host_tier: HostTier | None
    pooler: Pooler | None
    image_embedder: ImageEmbedder | None
    block_tables: BlockTables
    graphs: DecodeGraphs | None
    expert_balancer: ExpertBalancer | None
    _sent_downstream: bool  # this step's activations went to the next stage

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
