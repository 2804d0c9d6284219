"""What the client returns: plain dataclasses, converted from the wire once, here.

Names follow vLLM's `RequestOutput` / `CompletionOutput` where they exist; finish reasons are
the OpenAI/vLLM strings "stop", "length", "abort".
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protos.pagemesh.v1 import generate_pb2

_FINISH_REASONS = {
    generate_pb2.FINISH_REASON_LENGTH: "length",
    generate_pb2.FINISH_REASON_STOP: "stop",
    generate_pb2.FINISH_REASON_ABORT: "abort",
}


def finish_reason_from_pb(value: int) -> str | None:
    """None while the sample goes on."""
    return _FINISH_REASONS.get(generate_pb2.FinishReason.ValueType(value))


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    logprob: float  # natural log, under the model's unmodified distribution
    token: str


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int  # the generated token
    logprob: float  # natural log, under the model's unmodified distribution
    top: tuple[TopLogprob, ...] = ()  # best first, as many as `logprobs` asked

    @classmethod
    def from_pb(cls, pb: generate_pb2.TokenLogprob) -> TokenLogprob:
        return cls(
            pb.token_id,
            pb.logprob,
            tuple(TopLogprob(t.token_id, t.logprob, t.token) for t in pb.top),
        )


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int  # over every sample

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Chunk:
    """New output of one sample: each token and character of a request arrives in exactly
    one chunk, even across resumes."""

    request_id: str
    index: int  # which sample, 0..n-1
    token_ids: list[int]
    text: str  # whole UTF-8 characters
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token when asked
    finish_reason: str | None = None  # set on the sample's last chunk
    usage: Usage | None = None  # set on the request's last chunk (all samples), every sample


@dataclass
class SampleOutput:
    """One sample of a finished request (vLLM's `CompletionOutput`, over the wire)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class Completion:
    """A finished request: `outputs[i]` is sample i; `text`, `token_ids`, `logprobs` and
    `finish_reason` are sample 0's, for the common n=1 case."""

    request_id: str
    outputs: list[SampleOutput]
    usage: Usage | None = None
    num_resumes: int = 0  # times the stream broke and was resumed

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def logprobs(self) -> list[TokenLogprob]:
        return self.outputs[0].logprobs

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @classmethod
    def empty(cls, request_id: str, n: int) -> Completion:
        return cls(request_id, [SampleOutput(i) for i in range(max(n, 1))])

    def add(self, chunk: Chunk) -> None:
        output = self.outputs[chunk.index]
        output.text += chunk.text
        output.token_ids.extend(chunk.token_ids)
        output.logprobs.extend(chunk.logprobs)
        output.finish_reason = chunk.finish_reason or output.finish_reason
        self.usage = chunk.usage or self.usage


@dataclass(frozen=True)
class TokenizeResult:
    token_ids: list[int]
    tokens: list[str]  # each token's text piece, same length as token_ids


@dataclass(frozen=True)
class Embeddings:
    """An `embed` call's answer: one vector per input, in input order."""

    request_id: str
    embeddings: list[list[float]]
    num_prompt_tokens: int  # over all inputs

    @classmethod
    def from_pb(cls, pb: generate_pb2.EmbedResponse) -> Embeddings:
        vectors = sorted(pb.embeddings, key=lambda e: e.index)
        return cls(pb.request_id, [list(e.values) for e in vectors], pb.usage.prompt_tokens)


@dataclass(frozen=True)
class ModelInfo:
    model: str  # the served model's name
    max_model_len: int  # prompt + generated tokens of one request
    vocab_size: int
    eos_token_ids: list[int]
    dtype: str
    architecture: str
    tensor_parallel_size: int
    pipeline_parallel_size: int
    num_replicas: int  # engine groups behind the router
    block_size: int  # KV cache block, tokens
    num_kv_blocks: int  # per engine group
    quantization: str  # "none", "fp8" or "awq"
    weight_bytes: int  # one engine group's weights
    kv_cache_bytes: int  # one engine group's KV caches
    kv_cache_sizing: str  # how the KV cache was sized
    task: str = "generate"  # "generate" or "embed" (an embedding model: `embed`)
    embedding_size: int = 0  # an embedding model's full vector size

    @classmethod
    def from_pb(cls, pb: generate_pb2.GetModelInfoResponse) -> ModelInfo:
        return cls(
            model=pb.model,
            max_model_len=pb.max_model_len,
            vocab_size=pb.vocab_size,
            eos_token_ids=list(pb.eos_token_ids),
            dtype=pb.dtype,
            architecture=pb.architecture,
            tensor_parallel_size=pb.layout.tensor_parallel_size,
            pipeline_parallel_size=pb.layout.pipeline_parallel_size,
            num_replicas=pb.layout.num_replicas,
            block_size=pb.block_size,
            num_kv_blocks=pb.num_kv_blocks,
            quantization=pb.quantization,
            weight_bytes=pb.weight_bytes,
            kv_cache_bytes=pb.kv_cache_bytes,
            kv_cache_sizing=pb.kv_cache_sizing,
            task=pb.pooling.task or "generate",
            embedding_size=pb.pooling.embedding_size,
        )
