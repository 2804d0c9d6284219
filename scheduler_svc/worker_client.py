"""The scheduler's side of its engine group: find the workers in Redis, drive their steps."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc

from pagemesh.registry import Registry
from protos.pagemesh.worker.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerEndpoint:
    worker_id: str
    address: str
    tp_rank: int
    pp_rank: int


async def discover_workers(
    registry: Registry, group: str, num_workers: int, timeout_s: float
) -> list[WorkerEndpoint]:
    """Waits until `num_workers` workers of `group` are registered; sorted by (pp, tp) rank."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        found = [
            WorkerEndpoint(worker_id, info["address"], info.get("tp_rank", 0), info.get("pp_rank", 0))
            for worker_id, info in (await registry.list("worker")).items()
            if info.get("group") == group
        ]
        if len(found) >= num_workers:
            return sorted(found, key=lambda w: (w.pp_rank, w.tp_rank))[:num_workers]
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(
                f"only {len(found)} of {num_workers} workers of group {group!r} registered "
                f"after {timeout_s:.0f} s"
            )
        await asyncio.sleep(0.2)


class WorkerGroupClient:
    """Sends each step to every worker of the group and returns the sampling rank's answer."""

    def __init__(self, endpoints: list[WorkerEndpoint], step_timeout_s: float) -> None:
        self.endpoints = endpoints
        self.step_timeout_s = step_timeout_s
        self._channels = [
            grpc.aio.insecure_channel(
                e.address,
                options=[
                    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
                    ("grpc.max_send_message_length", 64 * 1024 * 1024),
                ],
            )
            for e in endpoints
        ]
        self._stubs = [worker_pb2_grpc.WorkerStub(c) for c in self._channels]

    async def get_info(self) -> list[worker_pb2.GetWorkerInfoResponse]:
        return list(
            await asyncio.gather(
                *(
                    stub.GetWorkerInfo(worker_pb2.GetWorkerInfoRequest(), timeout=30, wait_for_ready=True)
                    for stub in self._stubs
                )
            )
        )

    async def execute_step(self, request: worker_pb2.ExecuteStepRequest) -> worker_pb2.ExecuteStepResponse:
        responses = await asyncio.gather(
            *(stub.ExecuteStep(request, timeout=self.step_timeout_s) for stub in self._stubs)
        )
        # The last pipeline stage samples; its first tensor-parallel rank answers for the group.
        return responses[-1] if len(responses) == 1 else _sampling_response(responses)

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()


def _sampling_response(
    responses: list[worker_pb2.ExecuteStepResponse],
) -> worker_pb2.ExecuteStepResponse:
    with_tokens = [r for r in responses if r.sampled]
    return with_tokens[0] if with_tokens else responses[-1]
