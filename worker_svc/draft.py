"""Draft-model speculative decoding on the sampling rank (vLLM's `"model": ...` speculative
config): a smaller model with the same vocabulary proposes each request's next drafts at
the end of every step, and they go back to the scheduler with the step's tokens, which
sends them in the next step to be verified (worker_svc/spec_verify.py). No extra round
trip: the proposal is part of the step.

The draft keeps its own KV cache, laid out as the target's: the same number of blocks, the
same block ids, so a request's block table, slot mapping and prefix-cache hits serve both.
It follows the target step by step (`follow`: the draft runs over exactly the rows the
target ran), so its KV holds what the target's holds, prompt, chunks, accepted drafts and
all. Then `propose` feeds each sampled request its newest token and runs the draft k times,
one row per request, greedily, writing its KV in the request's blocks past its tokens
(slots the next steps overwrite). What the draft proposes never changes an output token,
only how many are kept: so a draft KV left stale (a swapped-out request's comes back with
the target's only) costs acceptance, not exactness.

The draft runs whole on the driver of the last stage, whatever the target's layout.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from protos.step import SampledToken
from worker_svc.attention import AttentionBackend
from worker_svc.batch import BlockTables, RequestState, StepBatch, build_batch
from worker_svc.kv_cache import KVCacheSpec, allocate_kv_caches, model_kv_spec, move_blocks
from worker_svc.loader import ModelMetadata, load_model
from worker_svc.model.matmul import pack_linear_weights

if TYPE_CHECKING:
    from worker_svc.runner_config import RunnerConfig

logger = logging.getLogger(__name__)


class DraftModel:
    """A loaded draft (its model, KV cache and attention backend) and `num_drafts` per
    proposal. Built by `load_draft`."""

    def __init__(
        self,
        model: torch.nn.Module,
        spec: KVCacheSpec,
        num_blocks: int,
        backend: AttentionBackend,
        device: torch.device,
        num_drafts: int,
        max_model_len: int,
    ) -> None:
        self.model = model
        self.kv_caches = allocate_kv_caches(spec, num_blocks, device)
        self.backend = backend
        self.block_size = spec.block_size
        self.num_drafts = num_drafts
        self.max_model_len = max_model_len

    @torch.inference_mode()
    def follow(self, batch: StepBatch) -> None:
        """The draft's KV for the step's rows, as the target computed its own."""
        self.model(
            batch.input_ids,
            batch.positions,
            self.kv_caches,
            batch.metadata,
            self.backend,
            None,
            None,
        )

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """A fork's copy of its leader's last prompt block, in the draft's cache too."""
        move_blocks(self.kv_caches, self.kv_caches, pairs)

    @torch.inference_mode()
    def propose(
        self,
        requests: Mapping[str, RequestState],
        tables: BlockTables,
        sampled: Mapping[str, SampledToken],
        spec_sampled: Mapping[str, Sequence[SampledToken]],
    ) -> dict[str, list[int]]:
        """Each sampled request's next drafts: the draft's greedy continuation of its tokens
        after this step, as many as `num_drafts`, the context and the request's blocks
        allow."""
        known: dict[str, list[int]] = {}
        room: dict[str, int] = {}
        for request_id, first in sampled.items():
            state = requests[request_id]
            accepted = spec_sampled.get(request_id, ())
            tokens = [*state.token_ids, first.token_id, *(t.token_id for t in accepted)]
            start = len(tokens) - 1  # the newest token's position: the draft has KV before it
            space = min(
                self.num_drafts,
                len(state.block_ids) * self.block_size - start,
                self.max_model_len - 1 - start,
            )
            if space > 0 and state.pooling is None:
                known[request_id], room[request_id] = tokens, space
        drafts: dict[str, list[int]] = {request_id: [] for request_id in known}
        for round_index in range(max(room.values(), default=0)):
            live = [r for r in known if room[r] > round_index]
            views = {
                r: dataclasses.replace(
                    requests[r],
                    token_ids=known[r],
                    num_computed_tokens=len(known[r]) - 1,
                    draft_token_ids=[],
                )
                for r in live
            }
            batch = build_batch(
                views, {r: 1 for r in live}, self.block_size, self.kv_caches[0].device, tables
            )
            hidden, residual = self.model(
                batch.input_ids,
                batch.positions,
                self.kv_caches,
                batch.metadata,
                self.backend,
                None,
                None,
            )
            rows = torch.tensor(batch.sample_rows, device=hidden.device)
            logits = self.model.compute_logits(hidden[rows], residual[rows])
            for request_id, token in zip(batch.sample_request_ids, logits.argmax(dim=-1).tolist()):
                known[request_id].append(token)
                drafts[request_id].append(token)
        return {r: tokens for r, tokens in drafts.items() if tokens}


def check_same_vocabulary(target_vocab_size: int, draft_vocab_size: int, draft_path: str) -> None:
    if target_vocab_size != draft_vocab_size:
        raise ValueError(
            f"the draft model {draft_path} has a vocabulary of {draft_vocab_size} "
            f"tokens and the served model {target_vocab_size}: a draft must "
            "share the served model's tokenizer"
        )


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """The draft model's folder (or .gguf) and the drafts it proposes per step."""

    model_path: str
    num_drafts: int


def draft_config(speculative: object) -> DraftConfig | None:
    """The workers' part of a `SpeculativeConfig` (scheduler_svc/core/spec_decode.py): the
    draft model, when its method has one."""
    model = getattr(speculative, "model", None)
    if not model:
        return None
    return DraftConfig(model, speculative.num_speculative_tokens)  # type: ignore[attr-defined]


def check_same_tokenizer(target_path: str, draft_path: str) -> None:
    """ValueError when the draft's tokenizer maps tokens to other ids than the served
    model's: its drafts would be another language to the target."""
    from pagemesh.runtime.tokenizer import load_tokenizer

    target, draft = load_tokenizer(target_path), load_tokenizer(draft_path)
    if target.hf.get_vocab() != draft.hf.get_vocab():
        raise ValueError(
            f"the draft model {draft_path} has another tokenizer than the served "
            f"model {target_path}: a draft must share its tokenizer (the same "
            "tokens for the same ids)"
        )


def load_draft(
    draft: DraftConfig, config: RunnerConfig, target: ModelMetadata
) -> tuple[torch.nn.Module, KVCacheSpec]:
    """The draft model, for the rank that samples, checked against the served model's
    tokenizer and vocabulary, its linear layers packed as the target's are."""
    check_same_tokenizer(target.path, draft.model_path)
    model, metadata = load_model(
        draft.model_path,
        dtype=config.dtype,
        device=config.device,
        max_model_len=target.max_model_len,
    )
    check_same_vocabulary(target.vocab_size, metadata.vocab_size, draft.model_path)
    pack_linear_weights(model, config.cpu_linear)
    logger.info(
        "draft model %s: %d layers, %d drafts a step",
        draft.model_path,
        model.num_local_layers,
        draft.num_drafts,
    )
    return model, model_kv_spec(model, config.block_size, metadata.dtype)
