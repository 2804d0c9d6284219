"""A Redis that restarts empty (killed -9, started again) gets the checkpoints of the requests
in flight back: the scheduler's registry notices the new run id at its next heartbeat and
its checkpointer writes every live record again, so a router that dies afterwards can still
be resumed from them."""

from __future__ import annotations

import asyncio
import os
import signal

from bench.faults.targets import RestartableValkey
from pagemesh.runtime.checkpoints import RUNNING, SampleState
from pagemesh.runtime.registry import Registry, RegistryConfig
from protos.pagemesh.scheduler.v1 import scheduler_pb2
from scheduler_svc.checkpoint import Checkpointer
from scheduler_svc.core.types import RequestEvent, SampledToken
from tests.support.eventually import eventually_async


def test_a_restarted_redis_gets_the_live_checkpoints_back() -> None:
    valkey = RestartableValkey()

    async def scenario() -> None:
        registry = Registry(
            RegistryConfig(valkey.url, cluster="ckpt-restart", heartbeat_interval_s=0.2, ttl_s=1.0)
        )
        checkpointer = Checkpointer(
            registry.checkpoints, "g0", interval_steps=1, resume_window_s=30
        )
        registry.on_redis_restart.append(checkpointer.rewrite_all)  # as scheduler_svc.main does
        await registry.start_heartbeat("scheduler", "g0", lambda: {"address": "x", "pid": 1})
        submit = scheduler_pb2.SubmitRequest(request_id="r1", prompt_token_ids=[1, 2, 3])
        checkpointer.track("r1", submit.SerializeToString(), [SampleState()])
        checkpointer.record("r1", 0, RequestEvent("r1", (SampledToken(7, 0.0),), None, 3))
        checkpointer.on_step()

        async def stored_tokens() -> list[int] | None:
            ckpt = await registry.checkpoints.load("r1")
            return ckpt.samples[0].token_ids if ckpt is not None else None

        assert await eventually_async(stored_tokens, 5, "never checkpointed") == [7]
        os.kill(valkey.pid, signal.SIGKILL)
        await asyncio.sleep(0.5)
        valkey.start()  # empty
        assert await eventually_async(stored_tokens, 10, "not rewritten after the restart") == [7]
        assert (await registry.checkpoints.load("r1")).state == RUNNING
        await checkpointer.close()
        await registry.close()

    try:
        asyncio.run(scenario())
    finally:
        valkey.stop()
