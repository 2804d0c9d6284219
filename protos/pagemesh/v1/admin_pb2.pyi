from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DrainRequest(_message.Message):
    __slots__ = ("group", "undo")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    UNDO_FIELD_NUMBER: _ClassVar[int]
    group: str
    undo: bool
    def __init__(self, group: _Optional[str] = ..., undo: _Optional[bool] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("groups", "num_migrated", "num_recomputed")
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    NUM_MIGRATED_FIELD_NUMBER: _ClassVar[int]
    NUM_RECOMPUTED_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedScalarFieldContainer[str]
    num_migrated: int
    num_recomputed: int
    def __init__(self, groups: _Optional[_Iterable[str]] = ..., num_migrated: _Optional[int] = ..., num_recomputed: _Optional[int] = ...) -> None: ...

class LoadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ...) -> None: ...

class LoadLoraAdapterResponse(_message.Message):
    __slots__ = ("groups", "lora_version", "loras")
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    LORA_VERSION_FIELD_NUMBER: _ClassVar[int]
    LORAS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedScalarFieldContainer[str]
    lora_version: int
    loras: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, groups: _Optional[_Iterable[str]] = ..., lora_version: _Optional[int] = ..., loras: _Optional[_Iterable[str]] = ...) -> None: ...

class UnloadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class UnloadLoraAdapterResponse(_message.Message):
    __slots__ = ("groups", "lora_version", "loras")
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    LORA_VERSION_FIELD_NUMBER: _ClassVar[int]
    LORAS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedScalarFieldContainer[str]
    lora_version: int
    loras: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, groups: _Optional[_Iterable[str]] = ..., lora_version: _Optional[int] = ..., loras: _Optional[_Iterable[str]] = ...) -> None: ...

class ResetPrefixCacheRequest(_message.Message):
    __slots__ = ("group",)
    GROUP_FIELD_NUMBER: _ClassVar[int]
    group: str
    def __init__(self, group: _Optional[str] = ...) -> None: ...

class GroupPrefixCacheReset(_message.Message):
    __slots__ = ("group", "scheduler_id", "num_blocks_dropped", "num_blocks_kept_in_use", "error")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_KEPT_IN_USE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    group: str
    scheduler_id: str
    num_blocks_dropped: int
    num_blocks_kept_in_use: int
    error: str
    def __init__(self, group: _Optional[str] = ..., scheduler_id: _Optional[str] = ..., num_blocks_dropped: _Optional[int] = ..., num_blocks_kept_in_use: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class ResetPrefixCacheResponse(_message.Message):
    __slots__ = ("groups",)
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[GroupPrefixCacheReset]
    def __init__(self, groups: _Optional[_Iterable[_Union[GroupPrefixCacheReset, _Mapping]]] = ...) -> None: ...

class GetMemoryRequest(_message.Message):
    __slots__ = ("group",)
    GROUP_FIELD_NUMBER: _ClassVar[int]
    group: str
    def __init__(self, group: _Optional[str] = ...) -> None: ...

class RankMemory(_message.Message):
    __slots__ = ("worker_id", "tp_rank", "pp_rank", "device", "weight_bytes", "num_allocated_kv_blocks", "kv_cache_bytes", "kv_bytes_per_block", "num_kv_blocks", "num_used_kv_blocks", "num_free_kv_blocks", "kv_cache_used_bytes", "num_swap_blocks", "num_used_swap_blocks", "swap_bytes", "rss_bytes", "device_allocated_bytes", "device_reserved_bytes", "device_total_bytes")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_ALLOCATED_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_SWAP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SWAP_BYTES_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ALLOCATED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    tp_rank: int
    pp_rank: int
    device: str
    weight_bytes: int
    num_allocated_kv_blocks: int
    kv_cache_bytes: int
    kv_bytes_per_block: int
    num_kv_blocks: int
    num_used_kv_blocks: int
    num_free_kv_blocks: int
    kv_cache_used_bytes: int
    num_swap_blocks: int
    num_used_swap_blocks: int
    swap_bytes: int
    rss_bytes: int
    device_allocated_bytes: int
    device_reserved_bytes: int
    device_total_bytes: int
    def __init__(self, worker_id: _Optional[str] = ..., tp_rank: _Optional[int] = ..., pp_rank: _Optional[int] = ..., device: _Optional[str] = ..., weight_bytes: _Optional[int] = ..., num_allocated_kv_blocks: _Optional[int] = ..., kv_cache_bytes: _Optional[int] = ..., kv_bytes_per_block: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., num_used_kv_blocks: _Optional[int] = ..., num_free_kv_blocks: _Optional[int] = ..., kv_cache_used_bytes: _Optional[int] = ..., num_swap_blocks: _Optional[int] = ..., num_used_swap_blocks: _Optional[int] = ..., swap_bytes: _Optional[int] = ..., rss_bytes: _Optional[int] = ..., device_allocated_bytes: _Optional[int] = ..., device_reserved_bytes: _Optional[int] = ..., device_total_bytes: _Optional[int] = ...) -> None: ...

class GroupMemory(_message.Message):
    __slots__ = ("group", "scheduler_id", "num_running", "num_cached_blocks", "ranks", "error")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    group: str
    scheduler_id: str
    num_running: int
    num_cached_blocks: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankMemory]
    error: str
    def __init__(self, group: _Optional[str] = ..., scheduler_id: _Optional[str] = ..., num_running: _Optional[int] = ..., num_cached_blocks: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankMemory, _Mapping]]] = ..., error: _Optional[str] = ...) -> None: ...

class GetMemoryResponse(_message.Message):
    __slots__ = ("groups",)
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[GroupMemory]
    def __init__(self, groups: _Optional[_Iterable[_Union[GroupMemory, _Mapping]]] = ...) -> None: ...

class GetStepStatsRequest(_message.Message):
    __slots__ = ("group", "window_s")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    group: str
    window_s: float
    def __init__(self, group: _Optional[str] = ..., window_s: _Optional[float] = ...) -> None: ...

class RankStepStats(_message.Message):
    __slots__ = ("worker_id", "tp_rank", "pp_rank", "num_steps", "busy_s", "collective_s", "pp_send_s", "pp_recv_s", "window_s", "window_num_steps", "window_busy_s", "window_communication_s", "utilization", "compute_fraction", "expert_load")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    BUSY_S_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_S_FIELD_NUMBER: _ClassVar[int]
    PP_SEND_S_FIELD_NUMBER: _ClassVar[int]
    PP_RECV_S_FIELD_NUMBER: _ClassVar[int]
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    WINDOW_NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_BUSY_S_FIELD_NUMBER: _ClassVar[int]
    WINDOW_COMMUNICATION_S_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_FRACTION_FIELD_NUMBER: _ClassVar[int]
    EXPERT_LOAD_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    tp_rank: int
    pp_rank: int
    num_steps: int
    busy_s: float
    collective_s: float
    pp_send_s: float
    pp_recv_s: float
    window_s: float
    window_num_steps: int
    window_busy_s: float
    window_communication_s: float
    utilization: float
    compute_fraction: float
    expert_load: _containers.RepeatedCompositeFieldContainer[ExpertLoad]
    def __init__(self, worker_id: _Optional[str] = ..., tp_rank: _Optional[int] = ..., pp_rank: _Optional[int] = ..., num_steps: _Optional[int] = ..., busy_s: _Optional[float] = ..., collective_s: _Optional[float] = ..., pp_send_s: _Optional[float] = ..., pp_recv_s: _Optional[float] = ..., window_s: _Optional[float] = ..., window_num_steps: _Optional[int] = ..., window_busy_s: _Optional[float] = ..., window_communication_s: _Optional[float] = ..., utilization: _Optional[float] = ..., compute_fraction: _Optional[float] = ..., expert_load: _Optional[_Iterable[_Union[ExpertLoad, _Mapping]]] = ...) -> None: ...

class ExpertLoad(_message.Message):
    __slots__ = ("layer", "tokens")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layer: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class GroupStepStats(_message.Message):
    __slots__ = ("group", "scheduler_id", "num_steps", "ranks", "error")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    group: str
    scheduler_id: str
    num_steps: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankStepStats]
    error: str
    def __init__(self, group: _Optional[str] = ..., scheduler_id: _Optional[str] = ..., num_steps: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankStepStats, _Mapping]]] = ..., error: _Optional[str] = ...) -> None: ...

class GetStepStatsResponse(_message.Message):
    __slots__ = ("groups",)
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[GroupStepStats]
    def __init__(self, groups: _Optional[_Iterable[_Union[GroupStepStats, _Mapping]]] = ...) -> None: ...

class StartProfileRequest(_message.Message):
    __slots__ = ("group", "out_dir", "record_shapes", "with_stack")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    OUT_DIR_FIELD_NUMBER: _ClassVar[int]
    RECORD_SHAPES_FIELD_NUMBER: _ClassVar[int]
    WITH_STACK_FIELD_NUMBER: _ClassVar[int]
    group: str
    out_dir: str
    record_shapes: bool
    with_stack: bool
    def __init__(self, group: _Optional[str] = ..., out_dir: _Optional[str] = ..., record_shapes: _Optional[bool] = ..., with_stack: _Optional[bool] = ...) -> None: ...

class GroupProfile(_message.Message):
    __slots__ = ("group", "scheduler_id", "traces", "error")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_ID_FIELD_NUMBER: _ClassVar[int]
    TRACES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    group: str
    scheduler_id: str
    traces: _containers.RepeatedCompositeFieldContainer[ProfileTrace]
    error: str
    def __init__(self, group: _Optional[str] = ..., scheduler_id: _Optional[str] = ..., traces: _Optional[_Iterable[_Union[ProfileTrace, _Mapping]]] = ..., error: _Optional[str] = ...) -> None: ...

class ProfileTrace(_message.Message):
    __slots__ = ("worker_id", "tp_rank", "pp_rank", "host", "path", "duration_s", "num_steps")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    tp_rank: int
    pp_rank: int
    host: str
    path: str
    duration_s: float
    num_steps: int
    def __init__(self, worker_id: _Optional[str] = ..., tp_rank: _Optional[int] = ..., pp_rank: _Optional[int] = ..., host: _Optional[str] = ..., path: _Optional[str] = ..., duration_s: _Optional[float] = ..., num_steps: _Optional[int] = ...) -> None: ...

class StartProfileResponse(_message.Message):
    __slots__ = ("groups",)
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[GroupProfile]
    def __init__(self, groups: _Optional[_Iterable[_Union[GroupProfile, _Mapping]]] = ...) -> None: ...

class StopProfileRequest(_message.Message):
    __slots__ = ("group",)
    GROUP_FIELD_NUMBER: _ClassVar[int]
    group: str
    def __init__(self, group: _Optional[str] = ...) -> None: ...

class StopProfileResponse(_message.Message):
    __slots__ = ("groups",)
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[GroupProfile]
    def __init__(self, groups: _Optional[_Iterable[_Union[GroupProfile, _Mapping]]] = ...) -> None: ...
