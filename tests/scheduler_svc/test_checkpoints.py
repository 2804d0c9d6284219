"""Checkpoints in a real Valkey: what the scheduler writes when, and how a resumed request
is rebuilt from one."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from pagemesh.runtime.checkpoints import (
    FINISHED,
    ORPHANED,
    RUNNING,
    Checkpoint,
    CheckpointStore,
    SampleState,
)
from protos.pagemesh.scheduler.v1 import scheduler_pb2
from protos.pagemesh.v1 import generate_pb2
from scheduler_svc import convert
from scheduler_svc.checkpoint import Checkpointer, admitted_samples
from scheduler_svc.core.admission import sample_index
from scheduler_svc.core.types import FinishReason, RequestEvent, SampledToken
from tests.support.eventually import eventually_async


def submit(n: int = 1) -> scheduler_pb2.SubmitRequest:
    return scheduler_pb2.SubmitRequest(
        request_id="r1",
        prompt_token_ids=[1, 2, 3],
        n=n,
        sampling=generate_pb2.SamplingParams(temperature=0.7, seed=42),
        stopping=generate_pb2.StoppingCriteria(max_tokens=8),
    )


def event(token_ids: list[int], reason: FinishReason | None = None) -> RequestEvent:
    return RequestEvent("r1", tuple(SampledToken(t, 0.0) for t in token_ids), reason, 3)


async def with_store(redis_url: str, cluster: str, body) -> None:  # type: ignore[no-untyped-def]
    client = aioredis.from_url(redis_url, decode_responses=True)
    try:
        store = CheckpointStore(client, cluster)
        await body(store, client)
        await store.images.close()
    finally:
        await client.aclose()


def test_written_on_admission_every_interval_and_on_finish(redis_url: str) -> None:
    async def body(store: CheckpointStore, client: aioredis.Redis) -> None:
        ckpt = Checkpointer(store, "g0", interval_steps=2, resume_window_s=30)
        ckpt.track("r1", submit().SerializeToString(), [SampleState()])
        first = await eventually_async(lambda: store.load("r1"), 5, "r1 never checkpointed")
        assert first.state == RUNNING and first.samples[0].token_ids == []
        # In flight: it expires a resume window after its last write, unless renewed.
        assert 25_000 < await client.pttl(store.key("r1")) <= 30_000

        ckpt.record("r1", 0, event([7]))
        ckpt.on_step()  # step 1 of 2: nothing written
        await asyncio.sleep(0.05)
        assert (await store.load("r1")).samples[0].token_ids == []
        ckpt.record("r1", 0, event([8]))
        ckpt.on_step()

        async def both_tokens() -> bool:
            stored = await store.load("r1")
            return stored is not None and stored.samples[0].token_ids == [7, 8]

        await eventually_async(both_tokens, 5, "step 2 of 2 wrote no checkpoint")

        ckpt.record("r1", 0, event([9], FinishReason.LENGTH))
        await ckpt.finish("r1")
        done = await store.load("r1")
        assert done.state == FINISHED and done.samples[0].finished
        assert done.samples[0].finish_reason == generate_pb2.FINISH_REASON_LENGTH
        assert 0 < await client.pttl(store.key("r1")) <= 30_000
        assert [c.request_id for c in await store.load_group("g0")] == ["r1"]
        assert ckpt.num_writes == 3

    asyncio.run(with_store(redis_url, "ckpt-a", body))


def test_orphans_expire_and_a_successor_adopts_what_was_running(redis_url: str) -> None:
    async def body(store: CheckpointStore, client: aioredis.Redis) -> None:
        await store.save([Checkpoint("dead-1", "g1", b"", [SampleState([4, 5])], RUNNING)])
        successor = Checkpointer(store, "g1", interval_steps=16, resume_window_s=60)
        assert await successor.adopt_orphans() == 1
        adopted = await store.load("dead-1")
        assert adopted.state == ORPHANED and adopted.samples[0].token_ids == [4, 5]
        assert 0 < await client.pttl(store.key("dead-1")) <= 60_000

        successor.track("r2", b"", [SampleState()])
        successor.orphan("r2")  # its router went away

        async def orphaned() -> bool:
            stored = await store.load("r2")
            return stored is not None and stored.state == ORPHANED

        await eventually_async(orphaned, 5, "r2 never marked orphaned")
        await store.delete("r2", "g1")
        assert await store.load("r2") is None

    asyncio.run(with_store(redis_url, "ckpt-b", body))


def test_running_records_are_renewed_and_expired_ids_pruned(redis_url: str) -> None:
    async def body(store: CheckpointStore, client: aioredis.Redis) -> None:
        ckpt = Checkpointer(store, "g2", interval_steps=1, resume_window_s=4)
        ckpt.track("alive", b"", [SampleState()])
        await eventually_async(lambda: store.load("alive"), 5, "never checkpointed")
        await store.save([Checkpoint("gone", "g2", b"", [SampleState()], RUNNING)], ttl_s=0.05)
        await asyncio.sleep(0.1)  # "gone" expired; its id is still in the group's set
        assert "gone" in await client.smembers(store.group_key("g2"))
        await client.pexpire(store.key("alive"), 1500)
        await asyncio.sleep(1.1)  # a quarter of the window: the next step renews
        ckpt.on_step()

        async def renewed() -> bool:
            return await client.pttl(store.key("alive")) > 2000

        await eventually_async(renewed, 5, "the running record was not renewed")
        assert await client.smembers(store.group_key("g2")) == {"alive"}

    asyncio.run(with_store(redis_url, "ckpt-c", body))


def test_redis_away_costs_checkpoints_not_the_caller() -> None:
    async def body() -> None:
        client = aioredis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2)
        ckpt = Checkpointer(
            CheckpointStore(client, "x"), "g0", interval_steps=1, resume_window_s=30
        )
        ckpt.track("r1", b"", [SampleState()])
        ckpt.on_step()
        await ckpt.finish("r1")  # bounded, and no exception
        assert ckpt.num_writes == 0
        await client.aclose()

    asyncio.run(body())


def test_off_writes_nothing(redis_url: str) -> None:
    async def body(store: CheckpointStore, client: aioredis.Redis) -> None:
        ckpt = Checkpointer(store, "g0", interval_steps=0, resume_window_s=30)
        ckpt.track("r1", b"", [SampleState()])
        ckpt.on_step()
        await ckpt.finish("r1")
        assert await store.load("r1") is None and not ckpt.enabled

    asyncio.run(with_store(redis_url, "ckpt-c", body))


def test_resumed_request_keeps_outputs_seeds_and_skips_finished_samples() -> None:
    request = submit(n=3)
    request.progress.add(index=0, token_ids=[10, 11], finished=True)
    request.progress.add(index=1, token_ids=[20, 21, 22])
    samples = convert.submission_from_pb(request, [0], 0.0).requests
    assert [s.request_id for s in samples] == ["r1#1", "r1#2"]
    assert samples[0].output_token_ids == [20, 21, 22] and samples[1].output_token_ids == []
    assert [s.sampling.seed for s in samples] == [43, 44]  # seed + index, as before the failure
    assert all(s.fork_of is None for s in samples)
    assert [sample_index(s.request_id, 3) for s in samples] == [1, 2]

    # The router lost the last message of samples whose tokens already end them.
    ended = submit(n=2)
    ended.progress.add(index=0, token_ids=[5] * 8)  # max_tokens reached
    ended.progress.add(index=1, token_ids=[5, 0])  # EOS (id 0) last
    submission = convert.submission_from_pb(ended, [0], 0.0)
    assert submission.requests == []
    assert submission.ended == [(0, FinishReason.LENGTH), (1, FinishReason.STOP)]


def test_a_submission_carries_what_admission_and_the_checkpoint_need() -> None:
    request = submit(n=2)
    request.logprobs = 2
    request.trace_context["traceparent"] = "00-" + "1" * 32 + "-" + "2" * 16 + "-01"
    request.progress.add(index=1, token_ids=[20, 21])
    submission = convert.submission_from_pb(request, [0], 5.0)
    assert (submission.request_id, submission.n, submission.with_logprobs) == ("r1", 2, True)
    assert submission.num_prompt_tokens == 3 and submission.resumed
    assert submission.progress == {1: ([20, 21], False)}
    assert submission.trace_context == dict(request.trace_context)
    assert [r.arrival_time_s for r in submission.requests] == [5.0, 5.0]
    # The checkpoint keeps the request as first submitted (its format is the router's too).
    original = scheduler_pb2.SubmitRequest.FromString(submission.original)
    assert not original.progress and not original.trace_context
    request.ClearField("progress")
    request.ClearField("trace_context")
    assert original == request


def test_delete_many_removes_every_checkpoint_and_group_entry_in_one_call(redis_url: str) -> None:
    async def body(store: CheckpointStore, client: aioredis.Redis) -> None:
        await store.save(
            [
                Checkpoint("m1", "g1", b"", [SampleState([1])], RUNNING),
                Checkpoint("m2", "g2", b"", [SampleState([2])], RUNNING),
                Checkpoint("m3", "g1", b"", [SampleState([3])], RUNNING),
            ]
        )
        await store.delete_many([("m1", "g1"), ("m2", "g2"), ("m2", None), ("gone", "g1")])
        await store.delete_many([])
        assert await store.load("m1") is None and await store.load("m2") is None
        assert await client.smembers(store.group_key("g1")) == {"m3"}
        assert await client.smembers(store.group_key("g2")) == set()

    asyncio.run(with_store(redis_url, "ckpt-many", body))


def test_the_checkpoint_keeps_logprobs_only_when_the_request_asks_for_them(redis_url: str) -> None:
    chosen = [
        SampledToken(7, -0.5, ((7, -0.5), (3, -1.25))),
        SampledToken(8, -0.75, ((8, -0.75), (1, -2.0))),
    ]

    async def body(store: CheckpointStore, client: aioredis.Redis) -> None:
        ckpt = Checkpointer(store, "g0", interval_steps=16, resume_window_s=30)
        asked = submit()
        asked.logprobs = 2
        ckpt.track(
            "r1",
            asked.SerializeToString(),
            admitted_samples(convert.submission_from_pb(asked, [0], 0.0)),
        )
        ckpt.track(
            "plain",
            submit().SerializeToString(),
            admitted_samples(convert.submission_from_pb(submit(), [0], 0.0)),
        )
        for request_id in ("r1", "plain"):
            ckpt.record(
                request_id, 0, RequestEvent(request_id, tuple(chosen), FinishReason.LENGTH, 3)
            )
        await ckpt.finish_many(["r1", "plain"])
        stored = (await store.load("r1")).samples[0]
        assert stored.token_ids == [7, 8]
        assert stored.logprobs == [
            (-0.5, [(7, -0.5), (3, -1.25)]),
            (-0.75, [(8, -0.75), (1, -2.0)]),
        ]
        assert (await store.load("plain")).samples[0].logprobs is None
        assert "logprobs" not in await client.get(store.key("plain"))

    asyncio.run(with_store(redis_url, "ckpt-logprobs", body))


def test_a_resume_keeps_the_logprobs_its_progress_came_with() -> None:
    request = submit(n=3)
    request.logprobs = 1
    request.progress.add(
        index=0,
        token_ids=[10, 11],
        logprobs=[
            scheduler_pb2.SampledLogprob(
                logprob=-0.5, top=[generate_pb2.TopLogprob(token_id=10, logprob=-0.5)]
            ),
            scheduler_pb2.SampledLogprob(
                logprob=-1.5, top=[generate_pb2.TopLogprob(token_id=4, logprob=-0.25)]
            ),
        ],
    )
    request.progress.add(index=1, token_ids=[20, 21])  # a router that sent none: not known
    samples = admitted_samples(convert.submission_from_pb(request, [0], 0.0))
    assert [(s.token_ids, s.logprobs) for s in samples] == [
        ([10, 11], [(-0.5, [(10, -0.5)]), (-1.5, [(4, -0.25)])]),
        ([20, 21], None),
        ([], []),  # not started: its logprobs are kept from its first token
    ]
    request.logprobs = 0  # logprobs that came with a request that asks for none are dropped
    assert all(
        s.logprobs is None for s in admitted_samples(convert.submission_from_pb(request, [0], 0.0))
    )
