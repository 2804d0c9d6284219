"""The router's own vocabulary: a generation request in, the client's token chunks out.

Pure: no gRPC, no protobuf. `router.generation.Generation` works on these; the gRPC servicer
(router/servicer.py, through router/convert.py) and the OpenAI HTTP API
(router/openai_protocol.py) each translate their wire format to and from them.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field

from pagemesh.api.options.constraint import OutputConstraint
from pagemesh.api.options.validation import (
    ModelLimits,
    SamplingOptions,
    StoppingOptions,
    ValidatedRequest,
)
from pagemesh.runtime.media import RemoteImage
from protos.step import ImageInput, ImageTiling, PoolingInfo


class FinishReason(enum.StrEnum):
    """Why a sample ended, spelled as OpenAI, the GenAI trace conventions and the router's
    metrics spell it."""

    LENGTH = "length"  # max_tokens reached or the context is full
    STOP = "stop"  # EOS, a stop token id or a stop string
    ABORT = "abort"  # the server aborted the request


@dataclass(frozen=True)
class BeamOptions:
    """`use_beam_search`: `width` beams (OpenAI's best_of, else n), the request's `n` best
    returned; transformers' `length_penalty` and `early_stopping` (True, False, "never")."""

    width: int
    length_penalty: float = 1.0
    early_stopping: bool | str = False


@dataclass(frozen=True)
class GenerationRequest:
    """One client request, as either API states it. Unset options are None / 0 and get their
    defaults from `pagemesh.api.options.validation.validate`."""

    request_id: str = ""  # empty: the router makes one up
    prompt: str | list[int] | None = None  # text (tokenized here) or token ids; None = missing
    apply_chat_template: bool = False  # `prompt` text is one user message of a chat
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    stopping: StoppingOptions = field(default_factory=StoppingOptions)
    num_logprobs: int | None = None  # alternatives per token, 0..20; None = no logprobs
    n: int = 1  # independent samples of the prompt
    priority: int = 0  # lower runs first under the priority policy
    # Output tokens the client has (router/replay.py): one count for every sample, or one per
    # sample (the HTTP API's per-choice offsets).
    resume_from: int | list[int] = 0
    model: str = ""  # empty, or the served model's name
    # The caller made `request_id` up just now (the HTTP API): no checkpoint can exist for
    # it, so none is looked up.
    new_request: bool = False
    constraint: OutputConstraint | None = None  # None: free text
    # The caller's key fingerprint (router/tenancy.py), set by the API adapter; "" = keys off.
    owner: str = ""
    # A vision-language prompt's images, in the order of its image tokens: encoded bytes, or
    # an http(s) URL the router fetches (pagemesh/runtime/media.py) before checking them.
    images: list[bytes | RemoteImage] = field(default_factory=list)
    beam: BeamOptions | None = None  # vLLM's `use_beam_search` (router/beam.py); None: off


@dataclass(frozen=True)
class Submission:
    """What the router asks an engine group to run for one request, as first sent: a fresh
    request's validated parameters with its seed drawn (`fresh`), or a checkpoint's
    (router/replay.py). The same for every attempt; router/convert.py `submit_request` makes
    it the scheduler's `SubmitRequest`, with the attempt's progress, where it is sent."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions  # defaults filled in, seed always set
    # max_tokens always set; the stop strings travel though the scheduler ignores them: its
    # checkpoint keeps them for a router resuming the request after this one died.
    stopping: StoppingOptions
    num_logprobs: int = 0  # top alternatives per token, 0..20; 0 = no logprobs
    n: int = 1  # independent samples of the prompt; sample i uses seed + i
    priority: int = 0  # lower runs first under the priority policy
    grammar: str = ""  # the output's grammar, llguidance's format (router/structured.py); "" = free
    # Whose request it is (router/tenancy.py): the key's fingerprint, "" with keys off; and
    # the request as the client stated it, to refuse the id's reuse for another request.
    owner: str = ""
    request_digest: str = ""
    # An embedding request (router/embedding.py): its Matryoshka dimensions (0 = full);
    # None for a generation.
    embed_dimensions: int | None = None
    embed_image: bytes = b""  # an image input's encoded image (its prompt: placeholders)
    # A vision-language prompt's images over their placeholder tokens.
    images: tuple[ImageInput, ...] = ()
    lora_name: str = ""  # the LoRA adapter it runs with; "" = the base model

    @classmethod
    def fresh(
        cls,
        request_id: str,
        validated: ValidatedRequest,
        seed: int,
        owner: str = "",
        request_digest: str = "",
    ) -> Submission:
        """`seed` replaces an unset one, so that every request is replayable (router/resume.py)."""
        sampling = validated.sampling
        if sampling.seed is None:
            sampling = dataclasses.replace(sampling, seed=seed)
        return cls(
            request_id,
            validated.prompt_token_ids,
            sampling,
            validated.stopping,
            validated.num_logprobs or 0,
            validated.n,
            validated.priority,
            validated.grammar,
            owner,
            request_digest,
        )

    @property
    def max_tokens(self) -> int:
        """Output tokens each sample may produce (0 only for a checkpoint that lacked it)."""
        return self.stopping.max_tokens or 0


@dataclass(frozen=True, slots=True)
class TopLogprob:
    token_id: int
    logprob: float  # natural log, under the model's unmodified distribution
    token: str  # the token's text


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int  # the chosen token
    logprob: float
    top: list[TopLogprob]  # the most likely alternatives, best first


@dataclass(frozen=True, slots=True)
class Usage:
    num_prompt_tokens: int
    num_completion_tokens: int  # summed over every sample
    # Speculative decoding, summed over every sample and attempt: drafts verified, kept.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass(frozen=True, slots=True)
class TokenChunk:
    """One message to the client: what one sample produced since its previous message."""

    request_id: str
    index: int  # the sample, 0..n-1
    token_ids: list[int]
    text: str  # whole UTF-8 characters, stop strings cut off
    logprobs: list[TokenLogprob]  # one per token when logprobs were asked for, else empty
    finish_reason: FinishReason | None = None  # set on the sample's last message
    usage: Usage | None = None  # set on the request's last message (every sample finished)


@dataclass(frozen=True)
class KVHandoff:
    """A sample's KV left on the group that computed it (`SubmitResponse.kv_handoff`); the
    next attempt's SubmitRequest carries it to the group that continues the sample."""

    index: int
    handoff_id: str
    num_tokens: int
    scheduler_address: str = ""  # the holding group's: filled in from the attempt's group


@dataclass(frozen=True, slots=True)
class SampleOutput:
    """One scheduler message for one sample, converted once where it enters the router
    (router/request_feed.py); checkpointed tokens are replayed as these too."""

    index: int  # the sample, 0..n-1
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    # Per token, (chosen token's logprob, [(alternative id, logprob), ...]); empty without logprobs.
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    embedding: bytes | None = None  # an embedding request's vector, float32 LE, at its end
    num_draft_tokens: int = 0  # speculative decoding: drafts verified in this message's step
    num_accepted_tokens: int = 0  # of those, the ones kept
    kv_handoff: KVHandoff | None = None  # the sample stops on this group, its KV held


@dataclass(frozen=True)
class ModelInfo:
    """The served model and the mesh serving it (`Generation.model_info`)."""

    model: str
    max_model_len: int  # tokens, prompt + output
    vocab_size: int
    eos_token_ids: list[int]
    dtype: str
    architecture: str
    block_size: int  # tokens per KV cache block
    num_kv_blocks: int  # per engine group
    quantization: str
    weight_bytes: int  # one engine group's weights
    kv_cache_bytes: int  # one engine group's KV caches
    kv_cache_sizing: str
    tensor_parallel_size: int
    pipeline_parallel_size: int
    num_replicas: int  # engine groups behind the router
    pooling: PoolingInfo = PoolingInfo()  # generate, or embed and how
    image_token_id: int = 0  # a vision-language model's image token
    image_seq_length: int = 0  # placeholders one image takes; 0: a text-only model
    image_tiling: ImageTiling = ImageTiling()  # LLaVA-NeXT: placeholders follow the size

    def limits(self) -> ModelLimits:
        """What `pagemesh.api.options.validation.validate` checks a request against."""
        return ModelLimits(
            name=self.model,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            eos_token_ids=list(self.eos_token_ids),
        )
