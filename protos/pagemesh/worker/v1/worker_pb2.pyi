from protos.pagemesh.v1 import admin_pb2 as _admin_pb2
from protos.pagemesh.v1 import generate_pb2 as _generate_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PullKvRequest(_message.Message):
    __slots__ = ("transfer_id", "sources", "src_block_ids", "dst_block_ids", "timeout_ms", "transfer_token")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    SRC_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    sources: _containers.RepeatedCompositeFieldContainer[KvRank]
    src_block_ids: _containers.RepeatedScalarFieldContainer[int]
    dst_block_ids: _containers.RepeatedScalarFieldContainer[int]
    timeout_ms: int
    transfer_token: str
    def __init__(self, transfer_id: _Optional[str] = ..., sources: _Optional[_Iterable[_Union[KvRank, _Mapping]]] = ..., src_block_ids: _Optional[_Iterable[int]] = ..., dst_block_ids: _Optional[_Iterable[int]] = ..., timeout_ms: _Optional[int] = ..., transfer_token: _Optional[str] = ...) -> None: ...

class KvRank(_message.Message):
    __slots__ = ("address", "host_key", "layer_start", "num_layers", "kv_head_start", "num_kv_heads", "block_size", "head_dim", "dtype")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HOST_KEY_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_START_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    address: str
    host_key: str
    layer_start: int
    num_layers: int
    kv_head_start: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: str
    def __init__(self, address: _Optional[str] = ..., host_key: _Optional[str] = ..., layer_start: _Optional[int] = ..., num_layers: _Optional[int] = ..., kv_head_start: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., block_size: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class PullKvResponse(_message.Message):
    __slots__ = ("ok", "reason", "num_bytes", "seconds", "path")
    OK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    reason: str
    num_bytes: int
    seconds: float
    path: str
    def __init__(self, ok: _Optional[bool] = ..., reason: _Optional[str] = ..., num_bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., path: _Optional[str] = ...) -> None: ...

class GetMemoryRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetMemoryResponse(_message.Message):
    __slots__ = ("memory",)
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    memory: _admin_pb2.RankMemory
    def __init__(self, memory: _Optional[_Union[_admin_pb2.RankMemory, _Mapping]] = ...) -> None: ...

class GetStepStatsRequest(_message.Message):
    __slots__ = ("window_s",)
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    window_s: float
    def __init__(self, window_s: _Optional[float] = ...) -> None: ...

class GetStepStatsResponse(_message.Message):
    __slots__ = ("stats",)
    STATS_FIELD_NUMBER: _ClassVar[int]
    stats: _admin_pb2.RankStepStats
    def __init__(self, stats: _Optional[_Union[_admin_pb2.RankStepStats, _Mapping]] = ...) -> None: ...

class StartProfileRequest(_message.Message):
    __slots__ = ("out_dir", "trace_name", "record_shapes", "with_stack")
    OUT_DIR_FIELD_NUMBER: _ClassVar[int]
    TRACE_NAME_FIELD_NUMBER: _ClassVar[int]
    RECORD_SHAPES_FIELD_NUMBER: _ClassVar[int]
    WITH_STACK_FIELD_NUMBER: _ClassVar[int]
    out_dir: str
    trace_name: str
    record_shapes: bool
    with_stack: bool
    def __init__(self, out_dir: _Optional[str] = ..., trace_name: _Optional[str] = ..., record_shapes: _Optional[bool] = ..., with_stack: _Optional[bool] = ...) -> None: ...

class StartProfileResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StopProfileRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StopProfileResponse(_message.Message):
    __slots__ = ("trace",)
    TRACE_FIELD_NUMBER: _ClassVar[int]
    trace: _admin_pb2.ProfileTrace
    def __init__(self, trace: _Optional[_Union[_admin_pb2.ProfileTrace, _Mapping]] = ...) -> None: ...

class GetWorkerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetWorkerInfoResponse(_message.Message):
    __slots__ = ("worker_id", "model", "architecture", "vocab_size", "eos_token_ids", "max_model_len", "dtype", "num_blocks", "block_size", "tp_rank", "tp_size", "pp_rank", "pp_size", "num_swap_blocks", "quantization", "weight_bytes", "kv_cache_bytes", "kv_cache_sizing", "pooling", "image_token_id", "image_seq_length", "image_tiling", "kv_transfer", "host_tier_slots", "host_tier_epoch")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_SIZING_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    IMAGE_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGE_SEQ_LENGTH_FIELD_NUMBER: _ClassVar[int]
    IMAGE_TILING_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_SLOTS_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    model: str
    architecture: str
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_model_len: int
    dtype: str
    num_blocks: int
    block_size: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    num_swap_blocks: int
    quantization: str
    weight_bytes: int
    kv_cache_bytes: int
    kv_cache_sizing: str
    pooling: _generate_pb2.PoolingInfo
    image_token_id: int
    image_seq_length: int
    image_tiling: _generate_pb2.ImageTiling
    kv_transfer: KvRank
    host_tier_slots: int
    host_tier_epoch: int
    def __init__(self, worker_id: _Optional[str] = ..., model: _Optional[str] = ..., architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_model_len: _Optional[int] = ..., dtype: _Optional[str] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., pp_rank: _Optional[int] = ..., pp_size: _Optional[int] = ..., num_swap_blocks: _Optional[int] = ..., quantization: _Optional[str] = ..., weight_bytes: _Optional[int] = ..., kv_cache_bytes: _Optional[int] = ..., kv_cache_sizing: _Optional[str] = ..., pooling: _Optional[_Union[_generate_pb2.PoolingInfo, _Mapping]] = ..., image_token_id: _Optional[int] = ..., image_seq_length: _Optional[int] = ..., image_tiling: _Optional[_Union[_generate_pb2.ImageTiling, _Mapping]] = ..., kv_transfer: _Optional[_Union[KvRank, _Mapping]] = ..., host_tier_slots: _Optional[int] = ..., host_tier_epoch: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "min_tokens", "stop_token_ids", "num_logprobs", "grammar")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_logprobs: int
    grammar: str
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., num_logprobs: _Optional[int] = ..., grammar: _Optional[str] = ...) -> None: ...

class NewRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "num_prompt_tokens", "block_ids", "num_computed_tokens", "sampling", "pooling", "images", "lora")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_tokens: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    sampling: SamplingParams
    pooling: PoolingParams
    images: _containers.RepeatedCompositeFieldContainer[_generate_pb2.ImageInput]
    lora: LoraAdapterRef
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_prompt_tokens: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., pooling: _Optional[_Union[PoolingParams, _Mapping]] = ..., images: _Optional[_Iterable[_Union[_generate_pb2.ImageInput, _Mapping]]] = ..., lora: _Optional[_Union[LoraAdapterRef, _Mapping]] = ...) -> None: ...

class LoraAdapterRef(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class PoolingParams(_message.Message):
    __slots__ = ("dimensions", "image")
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    dimensions: int
    image: bytes
    def __init__(self, dimensions: _Optional[int] = ..., image: _Optional[bytes] = ...) -> None: ...

class CachedRequest(_message.Message):
    __slots__ = ("request_id", "new_block_ids", "num_computed_tokens", "new_token_ids", "spec_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SPEC_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    spec_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., spec_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class BlockPair(_message.Message):
    __slots__ = ("src", "dst")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    src: int
    dst: int
    def __init__(self, src: _Optional[int] = ..., dst: _Optional[int] = ...) -> None: ...

class ExecuteStepRequest(_message.Message):
    __slots__ = ("step_id", "new_requests", "cached_requests", "num_scheduled_tokens", "finished_request_ids", "blocks_to_swap_out", "blocks_to_swap_in", "blocks_to_copy", "session_id", "sequence", "traceparents", "append_sampled_tokens", "blocks_to_offload")
    class NumScheduledTokensEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class TraceparentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CACHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TO_SWAP_OUT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TO_SWAP_IN_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TO_COPY_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENTS_FIELD_NUMBER: _ClassVar[int]
    APPEND_SAMPLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TO_OFFLOAD_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequest]
    cached_requests: _containers.RepeatedCompositeFieldContainer[CachedRequest]
    num_scheduled_tokens: _containers.ScalarMap[str, int]
    finished_request_ids: _containers.RepeatedScalarFieldContainer[str]
    blocks_to_swap_out: _containers.RepeatedCompositeFieldContainer[BlockPair]
    blocks_to_swap_in: _containers.RepeatedCompositeFieldContainer[BlockPair]
    blocks_to_copy: _containers.RepeatedCompositeFieldContainer[BlockPair]
    session_id: str
    sequence: int
    traceparents: _containers.ScalarMap[str, str]
    append_sampled_tokens: bool
    blocks_to_offload: _containers.RepeatedCompositeFieldContainer[TierStore]
    def __init__(self, step_id: _Optional[int] = ..., new_requests: _Optional[_Iterable[_Union[NewRequest, _Mapping]]] = ..., cached_requests: _Optional[_Iterable[_Union[CachedRequest, _Mapping]]] = ..., num_scheduled_tokens: _Optional[_Mapping[str, int]] = ..., finished_request_ids: _Optional[_Iterable[str]] = ..., blocks_to_swap_out: _Optional[_Iterable[_Union[BlockPair, _Mapping]]] = ..., blocks_to_swap_in: _Optional[_Iterable[_Union[BlockPair, _Mapping]]] = ..., blocks_to_copy: _Optional[_Iterable[_Union[BlockPair, _Mapping]]] = ..., session_id: _Optional[str] = ..., sequence: _Optional[int] = ..., traceparents: _Optional[_Mapping[str, str]] = ..., append_sampled_tokens: _Optional[bool] = ..., blocks_to_offload: _Optional[_Iterable[_Union[TierStore, _Mapping]]] = ...) -> None: ...

class TierStore(_message.Message):
    __slots__ = ("block", "slot", "key")
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    block: int
    slot: int
    key: bytes
    def __init__(self, block: _Optional[int] = ..., slot: _Optional[int] = ..., key: _Optional[bytes] = ...) -> None: ...

class LoadKvRequest(_message.Message):
    __slots__ = ("slots", "dst_block_ids", "keys", "epoch")
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    slots: _containers.RepeatedScalarFieldContainer[int]
    dst_block_ids: _containers.RepeatedScalarFieldContainer[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    epoch: int
    def __init__(self, slots: _Optional[_Iterable[int]] = ..., dst_block_ids: _Optional[_Iterable[int]] = ..., keys: _Optional[_Iterable[bytes]] = ..., epoch: _Optional[int] = ...) -> None: ...

class LoadKvResponse(_message.Message):
    __slots__ = ("ok", "reason", "failed_block_ids")
    OK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    FAILED_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    reason: str
    failed_block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ok: _Optional[bool] = ..., reason: _Optional[str] = ..., failed_block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class SampledToken(_message.Message):
    __slots__ = ("request_id", "token_id", "logprob", "top_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, request_id: _Optional[str] = ..., token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class ExecuteStepResponse(_message.Message):
    __slots__ = ("step_id", "sampled", "forward_time_ms", "pooled", "drafts")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    FORWARD_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    POOLED_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    sampled: _containers.RepeatedCompositeFieldContainer[SampledToken]
    forward_time_ms: float
    pooled: _containers.RepeatedCompositeFieldContainer[PooledOutput]
    drafts: _containers.RepeatedCompositeFieldContainer[DraftTokens]
    def __init__(self, step_id: _Optional[int] = ..., sampled: _Optional[_Iterable[_Union[SampledToken, _Mapping]]] = ..., forward_time_ms: _Optional[float] = ..., pooled: _Optional[_Iterable[_Union[PooledOutput, _Mapping]]] = ..., drafts: _Optional[_Iterable[_Union[DraftTokens, _Mapping]]] = ...) -> None: ...

class DraftTokens(_message.Message):
    __slots__ = ("request_id", "token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PooledOutput(_message.Message):
    __slots__ = ("request_id", "embedding")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    embedding: bytes
    def __init__(self, request_id: _Optional[str] = ..., embedding: _Optional[bytes] = ...) -> None: ...
