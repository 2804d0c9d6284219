"""The scheduler service's own messages, as plain data: what `convert/` makes of the
protobuf that comes in (a router's submit, a worker's info) and what it turns into the
protobuf that goes out (a sample's tokens, an in-band error). The servicer, the request
streams and the router connection work on these; none of them builds a protobuf message.

The step contract with the workers has its own plain types in `protos/step.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from pagemesh.runtime.checkpoints import TokenLogprobs
from protos.step import ImageInput, ImageTiling, PoolingInfo
from scheduler_svc.core.types import FinishReason, KVImport, Request, RequestEvent

# One sample's event on its way to a router, as the Connect stream's outbox holds it:
# (router request id, sample index, the event, whether its logprobs go along). A plain
# tuple, not a class: one is built per event of every step.
SampleOutput = tuple[str, int, RequestEvent, bool]


@dataclass(frozen=True)
class KVHandoffRef:
    """Where a sample's KV waits on another group (`SubmitRequest.kv_handoffs`)."""

    index: int  # the sample
    scheduler_address: str
    handoff_id: str
    num_tokens: int


@dataclass(frozen=True)
class TierSource:
    """Blocks of a request this group's host tiers hold: their slots and content keys."""

    slots: tuple[int, ...]
    keys: tuple[bytes, ...]


@dataclass(frozen=True)
class KVImportJob:
    """A request admitted importing (`Scheduler.add_importing`), and where its KV is."""

    request: Request
    kv: KVImport
    source: KVHandoffRef | TierSource


@dataclass(frozen=True)
class KVRank:
    """One rank's KV transfer server and its share of the KV cache (`worker.v1.KvRank`)."""

    address: str
    host_key: str
    layer_start: int
    num_layers: int
    kv_head_start: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: str


@dataclass(frozen=True)
class KVClaim:
    """A claimed hold on another group (`ClaimKvResponse`)."""

    block_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    ranks: tuple[KVRank, ...]
    transfer_token: str


@dataclass(frozen=True)
class PullResult:
    """One rank's answer to PullKv."""

    ok: bool
    reason: str
    num_bytes: int
    seconds: float
    path: str


@dataclass(frozen=True)
class Submission:
    """One router request as admitted: its samples, and what a resume carries."""

    request_id: str
    requests: list[Request]  # core requests of the samples that still have to run
    n: int  # samples of the request, >= 1
    with_logprobs: bool
    num_prompt_tokens: int
    # A resume's outputs so far: sample index -> (token ids, finished). Empty when new.
    progress: dict[int, tuple[list[int], bool]]
    # Resumed samples whose outputs already end them (the router lost their last message).
    ended: list[tuple[int, FinishReason]]
    trace_context: dict[str, str]  # the W3C carrier the message came with (may be empty)
    # The SubmitRequest as first submitted (no progress, no trace context), serialized:
    # what the checkpoint keeps to resume it (pagemesh/runtime/checkpoints.py).
    original: bytes
    # A resume's logprobs so far, for the checkpoint: sample index -> one per token of its
    # progress. Only samples whose progress came with logprobs for every token.
    progress_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)
    # A vision-language prompt's images: `original` holds their SHA-256s, the checkpoint's
    # image store their bytes (pagemesh/runtime/image_store.py).
    images: tuple[ImageInput, ...] = ()
    # Samples' KV held on other groups, by sample index (pulled instead of recomputed).
    kv_handoffs: dict[int, KVHandoffRef] = field(default_factory=dict)

    @property
    def resumed(self) -> bool:
        return bool(self.progress)

    @property
    def embeds(self) -> bool:
        """An embedding request: not checkpointed (a failed one is recomputed whole)."""
        return any(r.pooling is not None for r in self.requests)


@dataclass(frozen=True)
class InvalidSubmit:
    """A submit on a Connect stream that does not convert: refused in-band, alone."""

    request_id: str
    message: str


@dataclass(frozen=True)
class Abort:
    """A router gives up a request on its Connect stream."""

    request_id: str


# What a router's Connect stream sends up, converted (None: a message with no action).
ConnectAction = Submission | InvalidSubmit | Abort | None


@dataclass(frozen=True)
class RequestError:
    """One request's in-band failure on a Connect stream."""

    request_id: str
    code: grpc.StatusCode
    message: str


@dataclass
class ConnectBatch:
    """One message down a Connect stream: everything the outbox held."""

    outputs: list[SampleOutput]
    errors: list[RequestError]


@dataclass(frozen=True)
class WorkerInfo:
    """What one worker reports of itself (`Worker.GetWorkerInfo`)."""

    worker_id: str
    model: str
    architecture: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_model_len: int  # tokens of one request, prompt + output
    dtype: str
    num_blocks: int  # this rank's KV blocks; the group uses the minimum over its ranks
    block_size: int  # tokens per block
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    num_swap_blocks: int  # 0 = swapping off
    quantization: str
    weight_bytes: int  # this rank's weights in memory
    kv_cache_bytes: int  # this rank's KV cache
    kv_cache_sizing: str  # how that size was chosen, with the figures
    pooling: PoolingInfo = PoolingInfo()  # what the model does: generate, or embed and how
    image_token_id: int = 0  # a vision-language model's image token
    image_seq_length: int = 0  # placeholders one image takes (0: a text-only model)
    image_tiling: ImageTiling = ImageTiling()  # LLaVA-NeXT: placeholders follow the size
    kv_rank: KVRank | None = None  # its KV transfer server (None: its KV cannot move)
    host_tier_slots: int = 0  # its host tier's slots (0: none)
    host_tier_epoch: int = 0  # which tier: a new epoch is a tier re-made empty
