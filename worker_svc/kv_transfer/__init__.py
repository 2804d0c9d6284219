"""Moving a request's KV blocks between engine groups without gRPC on the data path:
`layout` (who holds what, who pulls what from whom), `server` (the source side), `pull`
(the destination side), `wire` (the format both speak)."""

from worker_svc.kv_transfer.layout import (
    PullPiece,
    RankSlice,
    TransferError,
    host_key,
    plan_pull,
    slice_for_rank,
)
from worker_svc.kv_transfer.pull import PullResult, pull_blocks
from worker_svc.kv_transfer.server import KVTransferServer

__all__ = [
    "KVTransferServer",
    "PullPiece",
    "PullResult",
    "RankSlice",
    "TransferError",
    "host_key",
    "plan_pull",
    "pull_blocks",
    "slice_for_rank",
]
