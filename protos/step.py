"""The step contract between a scheduler and its workers, as plain data (stdlib only).

vLLM v1's vocabulary, on both sides of the wire: the scheduler core builds a
`SchedulerOutput` each step, the workers run it and answer a `ModelRunnerOutput`. Each
service's `convert.py` is the only bridge between these types and `worker.proto`; nothing
else on either side sees the protobuf messages.

Token bookkeeping: a request's known tokens are `prompt + output so far`;
`num_computed_tokens` of them already have KV in the cache. A step computes
`num_scheduled_tokens[request_id]` more, starting at `num_computed_tokens`. When that
reaches the end of the known tokens the driver rank samples the next token and returns it;
the scheduler sends it back to every rank in the next step's `CachedRequestData.new_token_ids`
(unless `append_sampled_tokens`: then the driver, the only rank, appends it itself).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import NewType

RequestId = NewType("RequestId", str)
BlockId = int


@dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are drawn, with every default filled in.

    `temperature == 0` means greedy. `seed` is always set (the router draws one for an
    unseeded request) so that a request's randomness depends only on its seed and the index
    of the token being drawn, never on the batch it shares or the scheduler that runs it.
    """

    temperature: float = 1.0
    top_p: float = 1.0  # in (0, 1]; 1 = off
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = 0
    min_tokens: int = 0
    # Token ids that end the request (EOS unless ignored, plus the client's stop ids), in
    # ascending order; masked while fewer than `min_tokens` tokens have been generated.
    stop_token_ids: tuple[int, ...] = ()
    # Top alternatives returned per sampled token, with the chosen token's logprob;
    # 0 = neither (the client gets no logprobs).
    num_logprobs: int = 0
    # The grammar the output must follow (llguidance's format: Lark text or its JSON; compiled and
    # checked by the router); "" = free text. The sampler masks each draw to the tokens it
    # allows after the output so far.
    grammar: str = ""


@dataclass(frozen=True)
class PoolingParams:
    """An embedding request: its prompt is pooled into one vector when all of it is
    computed, instead of a token being sampled."""

    dimensions: int = 0  # Matryoshka: the first `dimensions` components, 0 = all
    # An image input (encoded PNG/JPEG/WebP/GIF) of a model that embeds images: the prompt
    # is then placeholder ids that only count in the budget.
    image: bytes = b""


@dataclass(frozen=True)
class PoolingInfo:
    """What a model does with a prompt (vLLM's runner): "generate", or "embed" with how its
    hidden states become one vector."""

    task: str = "generate"
    pooling_type: str = ""  # "last", "mean" or "cls" for "embed"
    normalize: bool = False  # unit L2 norm
    embedding_size: int = 0  # components of a full vector
    matryoshka_dimensions: tuple[int, ...] = ()  # the dimensions it accepts, besides full
    any_dimensions: bool = False  # any from 1 to embedding_size
    image_tokens: int = 0  # an image input's tokens in the budget; 0 = takes no images
    max_text_tokens: int = 0  # a text input's limit below max_model_len (CLIP: 77); 0 = none

    @property
    def embeds(self) -> bool:
        return self.task == "embed"

    @property
    def reads_every_token(self) -> bool:
        """Mean and CLS pooling read rows a prefix-cache hit or a preemption's swap would
        skip: such a request computes its whole prompt in one pass of chunks."""
        return self.embeds and self.pooling_type != "last"

    def dimensions_error(self, dimensions: int) -> str | None:
        """Why `dimensions` (0 = full size) cannot be asked of this model; None if it can."""
        if dimensions == 0:
            return None
        if not self.embeds:
            return "dimensions applies to embedding models only"
        if dimensions == self.embedding_size:
            return None
        if self.any_dimensions and 1 <= dimensions <= self.embedding_size:
            return None
        if dimensions in self.matryoshka_dimensions:
            return None
        accepted = (
            "any from 1 to " + str(self.embedding_size)
            if self.any_dimensions
            else ", ".join(map(str, self.matryoshka_dimensions)) or "none"
        )
        return (
            f"dimensions {dimensions} is not supported by this model (full size "
            f"{self.embedding_size}; Matryoshka dimensions it accepts: {accepted})"
        )


@dataclass(frozen=True)
class ImageInput:
    """An image in a generation prompt (a vision-language model): its encoded bytes, and
    the `length` placeholder tokens from prompt position `offset` that its embeddings
    replace. A step may compute any part of those positions (chunked prefill cuts through
    images); the embeddings are the image's, whichever part."""

    data: bytes
    offset: int
    length: int
    # SHA-256 of `data`, when known (the scheduler computes it once per request); `digest`
    # computes it otherwise. Not compared: it follows from `data`.
    sha256: bytes = field(default=b"", compare=False, repr=False)

    @property
    def digest(self) -> bytes:
        return self.sha256 or hashlib.sha256(self.data).digest()


@dataclass(frozen=True)
class LoraRef:
    """The LoRA adapter a request runs with: the name clients give it, and the PEFT folder
    the workers read it from (worker_svc/lora/)."""

    name: str
    path: str


@dataclass(frozen=True)
class ImageTiling:
    """LLaVA-NeXT's tiling ("anyres"): the (height, width) grids an image may be cut to, and
    the tile's and the patch's sides in pixels; an image's placeholder count follows its
    size (pagemesh/runtime/images_anyres.py). Empty (the default) for a fixed count per image."""

    grid_pinpoints: tuple[tuple[int, int], ...] = ()
    tile_size: int = 0
    patch_size: int = 0

    def __bool__(self) -> bool:
        return bool(self.grid_pinpoints)


@dataclass(frozen=True)
class NewRequestData:
    """A request the workers do not hold yet (first time, after a preemption, or a resume):
    sent in full once."""

    request_id: RequestId
    token_ids: list[int]  # prompt + any output already generated
    num_prompt_tokens: int
    block_ids: list[BlockId]
    num_computed_tokens: int
    sampling: SamplingParams
    pooling: PoolingParams | None = None  # an embedding request
    images: tuple[ImageInput, ...] = ()  # a vision-language prompt's, by offset
    lora: LoraRef | None = None  # the adapter it runs with; None = the base model


@dataclass(frozen=True)
class CachedRequestData:
    """A request the workers hold: only the blocks and tokens added since they last saw it."""

    request_id: RequestId
    new_block_ids: list[BlockId]
    num_computed_tokens: int
    # Tokens sampled since the workers last heard of the request (normally the one of its
    # previous step). Every rank learns sampled tokens this way, so pipeline stages that
    # never sample stay in step with the one that does.
    new_token_ids: list[int] = field(default_factory=list)
    # Speculative decoding: draft tokens to verify after the request's last known token
    # (scheduled with it: num_scheduled_tokens = 1 + len). The sampling rank draws a token at
    # each of those positions as it would without drafts, and keeps drafts while they equal
    # its draws (ModelRunnerOutput.spec_sampled); the rest of their KV is overwritten later.
    spec_token_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """One step: what every worker of the group computes."""

    step_id: int
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    # request id -> tokens computed this step (>= 1 for every scheduled request)
    num_scheduled_tokens: dict[RequestId, int] = field(default_factory=dict)
    # Requests the workers must forget before this step (finished, aborted, preempted).
    finished_request_ids: list[RequestId] = field(default_factory=list)
    # KV block moves applied before the forward, in this order: (device block, swap block)
    # copies to CPU swap space, (swap block, device block) copies back, then (source,
    # destination) device copies (a fork's private copy of its leader's last prompt block).
    blocks_to_swap_out: list[tuple[BlockId, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, BlockId]] = field(default_factory=list)
    blocks_to_copy: list[tuple[BlockId, BlockId]] = field(default_factory=list)
    # Host tier write-through, before the forward too: (device block, tier slot, the
    # block's content key) for full blocks the prefix cache just took in.
    blocks_to_offload: list[tuple[BlockId, int, bytes]] = field(default_factory=list)
    # The driver appends each token it samples to the request itself, and `new_token_ids`
    # carry none of those (async scheduling, a group of one rank).
    append_sampled_tokens: bool = False

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not (
            self.num_scheduled_tokens
            or self.finished_request_ids
            or self.blocks_to_swap_out
            or self.blocks_to_swap_in
            or self.blocks_to_copy
            or self.blocks_to_offload
        )


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    # Of the chosen token under the model's raw distribution; 0.0 (not computed) when the
    # request asked for no logprobs.
    logprob: float = 0.0
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), best first


@dataclass
class ModelRunnerOutput:
    """What the workers return for one step."""

    step_id: int
    # Only requests whose scheduled tokens reached the end of their known tokens.
    sampled: dict[RequestId, SampledToken] = field(default_factory=dict)
    # Speculative decoding: the tokens drawn after `sampled`'s, one per draft that equalled
    # the token drawn before it (so `sampled` plus these are 1 to 1 + len(drafts) tokens).
    spec_sampled: dict[RequestId, list[SampledToken]] = field(default_factory=dict)
    forward_time_ms: float = 0.0  # the driver's forward pass, for the step span
    # Embedding requests whose prompt was completed this step: the vector, float32
    # little-endian (pooled, cut to its dimensions, normalised where the model says).
    pooled: dict[RequestId, bytes] = field(default_factory=dict)
    # Draft-model speculative decoding: each sampled request's drafts for its next step
    # (worker_svc/draft.py), after the tokens above.
    draft_token_ids: dict[RequestId, list[int]] = field(default_factory=dict)
