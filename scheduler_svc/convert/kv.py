"""KV moving between groups (scheduler_svc/kv_moves.py): the ranks that hold a group's KV,
a hold claimed and released on another group's scheduler (`scheduler.proto`), the workers'
pulls and host-tier loads (`worker.proto`), and a drain's reply (`admin.proto`)."""

from __future__ import annotations

from collections.abc import Sequence

from protos.pagemesh.scheduler.v1 import scheduler_pb2
from protos.pagemesh.v1 import admin_pb2
from protos.pagemesh.worker.v1 import worker_pb2
from scheduler_svc.core.types import HeldKV
from scheduler_svc.messages import KVClaim, KVRank, PullResult


def kv_rank_from_pb(pb: worker_pb2.KvRank) -> KVRank:
    return KVRank(
        pb.address,
        pb.host_key,
        pb.layer_start,
        pb.num_layers,
        pb.kv_head_start,
        pb.num_kv_heads,
        pb.block_size,
        pb.head_dim,
        pb.dtype,
    )


def _kv_rank_to_pb(rank: KVRank) -> worker_pb2.KvRank:
    return worker_pb2.KvRank(
        address=rank.address,
        host_key=rank.host_key,
        layer_start=rank.layer_start,
        num_layers=rank.num_layers,
        kv_head_start=rank.kv_head_start,
        num_kv_heads=rank.num_kv_heads,
        block_size=rank.block_size,
        head_dim=rank.head_dim,
        dtype=rank.dtype,
    )


def claim_request_pb(handoff_id: str, hold_ms: int) -> scheduler_pb2.ClaimKvRequest:
    return scheduler_pb2.ClaimKvRequest(handoff_id=handoff_id, hold_ms=hold_ms)


def claim_response_pb(
    held: HeldKV, ranks: Sequence[KVRank], token: str
) -> scheduler_pb2.ClaimKvResponse:
    return scheduler_pb2.ClaimKvResponse(
        block_ids=held.block_ids,
        token_ids=held.token_ids,
        ranks=[_kv_rank_to_pb(rank) for rank in ranks],
        transfer_token=token,
    )


def claim_from_pb(pb: scheduler_pb2.ClaimKvResponse) -> KVClaim:
    return KVClaim(
        tuple(pb.block_ids),
        tuple(pb.token_ids),
        tuple(kv_rank_from_pb(rank) for rank in pb.ranks),
        pb.transfer_token,
    )


def release_request_pb(
    handoff_id: str, pulled: bool, reason: str
) -> scheduler_pb2.ReleaseKvRequest:
    return scheduler_pb2.ReleaseKvRequest(handoff_id=handoff_id, pulled=pulled, reason=reason)


def pull_request_pb(
    transfer_id: str,
    claim: KVClaim,
    src_block_ids: Sequence[int],
    dst_block_ids: Sequence[int],
    timeout_ms: int,
) -> worker_pb2.PullKvRequest:
    return worker_pb2.PullKvRequest(
        transfer_id=transfer_id,
        sources=[_kv_rank_to_pb(rank) for rank in claim.ranks],
        src_block_ids=src_block_ids,
        dst_block_ids=dst_block_ids,
        timeout_ms=timeout_ms,
        transfer_token=claim.transfer_token,
    )


def load_request_pb(
    slots: Sequence[int], dst_block_ids: Sequence[int], keys: Sequence[bytes], epoch: int
) -> worker_pb2.LoadKvRequest:
    return worker_pb2.LoadKvRequest(
        slots=slots, dst_block_ids=dst_block_ids, keys=keys, epoch=epoch
    )


def pull_result_from_pb(pb: worker_pb2.PullKvResponse) -> PullResult:
    return PullResult(pb.ok, pb.reason, pb.num_bytes, pb.seconds, pb.path)


def drain_response_pb(
    groups: Sequence[str], num_migrated: int, num_recomputed: int
) -> admin_pb2.DrainResponse:
    return admin_pb2.DrainResponse(
        groups=groups, num_migrated=num_migrated, num_recomputed=num_recomputed
    )
