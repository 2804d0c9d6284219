"""The only place on the scheduler that builds or reads protobuf messages: the router's
submits and the replies to them (`scheduler.proto`), the steps and worker infos of the
engine group (`worker.proto`), model info and stats (`generate.proto`). Everything else
works on plain types: `messages.py` (this service's), `protos/step.py` (the step contract)
and the core's. Three other files import generated modules, for the gRPC plumbing alone
(tests/scheduler_svc/test_protobuf_edge.py holds them to it): `servicer.py`, the adapter,
implements and registers the generated service and hands what it receives to these
functions (it reads only the request id it logs under and the model's EOS ids);
`worker_client.py` holds the workers' stubs and sends what these functions build, and
`kv_moves.py` other groups' schedulers' stubs, for their KV holds.

Callers use this package's names (`convert.submission_from_pb`); its modules split them by
the messages they convert:
- `requests.py`: the router's submits and Connect streams in, each sample's events out;
- `steps.py`: the step the workers run, and the tokens they sampled;
- `group_info.py`: the workers' info in; the group's model info and stats out;
- `admin.py`: the admin calls forwarded to the workers, and their replies;
- `kv.py`: KV moving between groups (holds, pulls, host-tier loads, drains).
"""

from __future__ import annotations

from scheduler_svc.convert.admin import (
    ProfileTraceReport,
    RankMemoryReport,
    RankStepStatsReport,
    group_memory_to_pb,
    group_profile,
    group_step_stats_to_pb,
    lora_load_request_pb,
    lora_loaded_pb,
    lora_unload_request_pb,
    lora_unloaded_pb,
    memory_request_pb,
    prefix_cache_reset_to_pb,
    start_profile_request_pb,
    step_stats_request_pb,
    stop_profile_request_pb,
)
from scheduler_svc.convert.group_info import (
    GROUP_STATUS_TO_PB,
    model_info_to_pb,
    stats_to_pb,
    worker_info_from_pb,
    worker_info_request_pb,
)
from scheduler_svc.convert.kv import (
    claim_from_pb,
    claim_request_pb,
    claim_response_pb,
    drain_response_pb,
    load_request_pb,
    pull_request_pb,
    pull_result_from_pb,
    release_request_pb,
)
from scheduler_svc.convert.requests import (
    connect_action_from_pb,
    connect_batch_to_pb,
    event_to_pb,
    finish_reason_to_pb,
    submission_from_pb,
)
from scheduler_svc.convert.steps import model_runner_output_from_pb, scheduler_output_to_pb

__all__ = [
    # requests.py
    "submission_from_pb",
    "connect_action_from_pb",
    "finish_reason_to_pb",
    "event_to_pb",
    "connect_batch_to_pb",
    # steps.py
    "scheduler_output_to_pb",
    "model_runner_output_from_pb",
    # group_info.py
    "worker_info_request_pb",
    "worker_info_from_pb",
    "model_info_to_pb",
    "GROUP_STATUS_TO_PB",
    "stats_to_pb",
    # admin.py
    "RankMemoryReport",
    "RankStepStatsReport",
    "ProfileTraceReport",
    "memory_request_pb",
    "step_stats_request_pb",
    "start_profile_request_pb",
    "stop_profile_request_pb",
    "prefix_cache_reset_to_pb",
    "group_memory_to_pb",
    "group_step_stats_to_pb",
    "group_profile",
    "lora_load_request_pb",
    "lora_unload_request_pb",
    "lora_loaded_pb",
    "lora_unloaded_pb",
    # kv.py
    "claim_request_pb",
    "claim_response_pb",
    "claim_from_pb",
    "release_request_pb",
    "pull_request_pb",
    "load_request_pb",
    "pull_result_from_pb",
    "drain_response_pb",
]
