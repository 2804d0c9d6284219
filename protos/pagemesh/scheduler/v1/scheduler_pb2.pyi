from protos.pagemesh.v1 import admin_pb2 as _admin_pb2
from protos.pagemesh.v1 import generate_pb2 as _generate_pb2
from protos.pagemesh.worker.v1 import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GroupStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GROUP_STATUS_UNSPECIFIED: _ClassVar[GroupStatus]
    GROUP_STATUS_READY: _ClassVar[GroupStatus]
    GROUP_STATUS_DEGRADED: _ClassVar[GroupStatus]
    GROUP_STATUS_DRAINING: _ClassVar[GroupStatus]
GROUP_STATUS_UNSPECIFIED: GroupStatus
GROUP_STATUS_READY: GroupStatus
GROUP_STATUS_DEGRADED: GroupStatus
GROUP_STATUS_DRAINING: GroupStatus

class KvHandoff(_message.Message):
    __slots__ = ("index", "scheduler_address", "handoff_id", "num_tokens")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    index: int
    scheduler_address: str
    handoff_id: str
    num_tokens: int
    def __init__(self, index: _Optional[int] = ..., scheduler_address: _Optional[str] = ..., handoff_id: _Optional[str] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class ClaimKvRequest(_message.Message):
    __slots__ = ("handoff_id", "hold_ms")
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    HOLD_MS_FIELD_NUMBER: _ClassVar[int]
    handoff_id: str
    hold_ms: int
    def __init__(self, handoff_id: _Optional[str] = ..., hold_ms: _Optional[int] = ...) -> None: ...

class ClaimKvResponse(_message.Message):
    __slots__ = ("block_ids", "token_ids", "ranks", "transfer_token")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    ranks: _containers.RepeatedCompositeFieldContainer[_worker_pb2.KvRank]
    transfer_token: str
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., ranks: _Optional[_Iterable[_Union[_worker_pb2.KvRank, _Mapping]]] = ..., transfer_token: _Optional[str] = ...) -> None: ...

class ReleaseKvRequest(_message.Message):
    __slots__ = ("handoff_id", "pulled", "reason")
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    PULLED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    handoff_id: str
    pulled: bool
    reason: str
    def __init__(self, handoff_id: _Optional[str] = ..., pulled: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class ReleaseKvResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetPrefixCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetPrefixCacheResponse(_message.Message):
    __slots__ = ("group",)
    GROUP_FIELD_NUMBER: _ClassVar[int]
    group: _admin_pb2.GroupPrefixCacheReset
    def __init__(self, group: _Optional[_Union[_admin_pb2.GroupPrefixCacheReset, _Mapping]] = ...) -> None: ...

class GetMemoryRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetMemoryResponse(_message.Message):
    __slots__ = ("group",)
    GROUP_FIELD_NUMBER: _ClassVar[int]
    group: _admin_pb2.GroupMemory
    def __init__(self, group: _Optional[_Union[_admin_pb2.GroupMemory, _Mapping]] = ...) -> None: ...

class GetStepStatsRequest(_message.Message):
    __slots__ = ("window_s",)
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    window_s: float
    def __init__(self, window_s: _Optional[float] = ...) -> None: ...

class GetStepStatsResponse(_message.Message):
    __slots__ = ("group",)
    GROUP_FIELD_NUMBER: _ClassVar[int]
    group: _admin_pb2.GroupStepStats
    def __init__(self, group: _Optional[_Union[_admin_pb2.GroupStepStats, _Mapping]] = ...) -> None: ...

class StartProfileRequest(_message.Message):
    __slots__ = ("out_dir", "record_shapes", "with_stack")
    OUT_DIR_FIELD_NUMBER: _ClassVar[int]
    RECORD_SHAPES_FIELD_NUMBER: _ClassVar[int]
    WITH_STACK_FIELD_NUMBER: _ClassVar[int]
    out_dir: str
    record_shapes: bool
    with_stack: bool
    def __init__(self, out_dir: _Optional[str] = ..., record_shapes: _Optional[bool] = ..., with_stack: _Optional[bool] = ...) -> None: ...

class StartProfileResponse(_message.Message):
    __slots__ = ("group",)
    GROUP_FIELD_NUMBER: _ClassVar[int]
    group: _admin_pb2.GroupProfile
    def __init__(self, group: _Optional[_Union[_admin_pb2.GroupProfile, _Mapping]] = ...) -> None: ...

class StopProfileRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StopProfileResponse(_message.Message):
    __slots__ = ("group",)
    GROUP_FIELD_NUMBER: _ClassVar[int]
    group: _admin_pb2.GroupProfile
    def __init__(self, group: _Optional[_Union[_admin_pb2.GroupProfile, _Mapping]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("num_running", "num_waiting", "num_free_blocks", "num_blocks", "num_preemptions", "num_steps", "prefix_cache_hit_rate", "num_cached_blocks", "num_recoveries", "group_status", "num_swap_outs", "num_swap_ins", "prefix_cache_queries", "prefix_cache_hits", "num_draft_tokens", "num_accepted_tokens", "num_drafts")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RECOVERIES_FIELD_NUMBER: _ClassVar[int]
    GROUP_STATUS_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAP_OUTS_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAP_INS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    num_preemptions: int
    num_steps: int
    prefix_cache_hit_rate: float
    num_cached_blocks: int
    num_recoveries: int
    group_status: GroupStatus
    num_swap_outs: int
    num_swap_ins: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_drafts: int
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., num_steps: _Optional[int] = ..., prefix_cache_hit_rate: _Optional[float] = ..., num_cached_blocks: _Optional[int] = ..., num_recoveries: _Optional[int] = ..., group_status: _Optional[_Union[GroupStatus, str]] = ..., num_swap_outs: _Optional[int] = ..., num_swap_ins: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ..., num_accepted_tokens: _Optional[int] = ..., num_drafts: _Optional[int] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "stopping", "logprobs", "n", "priority", "progress", "trace_context", "grammar", "owner", "request_digest", "embed", "images", "lora_name", "kv_handoffs")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    REQUEST_DIGEST_FIELD_NUMBER: _ClassVar[int]
    EMBED_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    KV_HANDOFFS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generate_pb2.SamplingParams
    stopping: _generate_pb2.StoppingCriteria
    logprobs: int
    n: int
    priority: int
    progress: _containers.RepeatedCompositeFieldContainer[SampleProgress]
    trace_context: _containers.ScalarMap[str, str]
    grammar: str
    owner: str
    request_digest: str
    embed: EmbedParams
    images: _containers.RepeatedCompositeFieldContainer[_generate_pb2.ImageInput]
    lora_name: str
    kv_handoffs: _containers.RepeatedCompositeFieldContainer[KvHandoff]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generate_pb2.SamplingParams, _Mapping]] = ..., stopping: _Optional[_Union[_generate_pb2.StoppingCriteria, _Mapping]] = ..., logprobs: _Optional[int] = ..., n: _Optional[int] = ..., priority: _Optional[int] = ..., progress: _Optional[_Iterable[_Union[SampleProgress, _Mapping]]] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., grammar: _Optional[str] = ..., owner: _Optional[str] = ..., request_digest: _Optional[str] = ..., embed: _Optional[_Union[EmbedParams, _Mapping]] = ..., images: _Optional[_Iterable[_Union[_generate_pb2.ImageInput, _Mapping]]] = ..., lora_name: _Optional[str] = ..., kv_handoffs: _Optional[_Iterable[_Union[KvHandoff, _Mapping]]] = ...) -> None: ...

class EmbedParams(_message.Message):
    __slots__ = ("dimensions", "image")
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    dimensions: int
    image: bytes
    def __init__(self, dimensions: _Optional[int] = ..., image: _Optional[bytes] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ConnectRequest(_message.Message):
    __slots__ = ("submit", "abort")
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    submit: SubmitRequest
    abort: AbortRequest
    def __init__(self, submit: _Optional[_Union[SubmitRequest, _Mapping]] = ..., abort: _Optional[_Union[AbortRequest, _Mapping]] = ...) -> None: ...

class RequestError(_message.Message):
    __slots__ = ("request_id", "code", "message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    code: int
    message: str
    def __init__(self, request_id: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class ConnectResponse(_message.Message):
    __slots__ = ("outputs", "errors")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[SubmitResponse]
    errors: _containers.RepeatedCompositeFieldContainer[RequestError]
    def __init__(self, outputs: _Optional[_Iterable[_Union[SubmitResponse, _Mapping]]] = ..., errors: _Optional[_Iterable[_Union[RequestError, _Mapping]]] = ...) -> None: ...

class SampleProgress(_message.Message):
    __slots__ = ("index", "token_ids", "finished", "logprobs")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finished: bool
    logprobs: _containers.RepeatedCompositeFieldContainer[SampledLogprob]
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., finished: _Optional[bool] = ..., logprobs: _Optional[_Iterable[_Union[SampledLogprob, _Mapping]]] = ...) -> None: ...

class SampledLogprob(_message.Message):
    __slots__ = ("logprob", "top")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[_generate_pb2.TopLogprob]
    def __init__(self, logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[_generate_pb2.TopLogprob, _Mapping]]] = ...) -> None: ...

class SubmitResponse(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "num_prompt_tokens", "index", "request_id", "embedding", "num_draft_tokens", "num_accepted_tokens", "kv_handoff")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_HANDOFF_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[SampledLogprob]
    finish_reason: _generate_pb2.FinishReason
    num_prompt_tokens: int
    index: int
    request_id: str
    embedding: bytes
    num_draft_tokens: int
    num_accepted_tokens: int
    kv_handoff: KvHandoff
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[SampledLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[_generate_pb2.FinishReason, str]] = ..., num_prompt_tokens: _Optional[int] = ..., index: _Optional[int] = ..., request_id: _Optional[str] = ..., embedding: _Optional[bytes] = ..., num_draft_tokens: _Optional[int] = ..., num_accepted_tokens: _Optional[int] = ..., kv_handoff: _Optional[_Union[KvHandoff, _Mapping]] = ...) -> None: ...
