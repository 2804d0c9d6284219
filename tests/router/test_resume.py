"""Fault tolerance through a real router: streams resumed across scheduler failures, resume_from
on a fresh router, checkpoint deletion, groups' health.

Real gRPC on 127.0.0.1 and a real Valkey; the schedulers are scripted: each serves real gRPC,
heartbeats into the registry like a scheduler, and samples a deterministic function of
(seed, sample, position), so the undisturbed output is known in advance.
"""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
from grpc_health.v1 import health_pb2

from pagemesh.api.options.validation import SamplingOptions, StoppingOptions, ValidatedRequest
from pagemesh.runtime.checkpoints import FINISHED, ORPHANED, RUNNING, Checkpoint, SampleState
from pagemesh.runtime.tokenizer import Tokenizer, load_tokenizer
from protos.pagemesh.v1 import generate_pb2
from router import convert
from router.resume import Attempts, Progress, ResumeConfig, retry_kind
from router.types import Submission
from tests.support.bpe_folder import write_bpe_folder
from tests.support.scripted_router import (
    LENGTH,
    SEED,
    STOP,
    Router,
    expected,
    per_sample,
    request,
    run,
    until,
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return load_tokenizer(str(write_bpe_folder(tmp_path_factory.mktemp("bpe"))))


# --- resume after the first token ---------------------------------------------------------


@pytest.mark.parametrize("n,num_failures", [(1, 1), (2, 1), (2, 2)])
def test_a_group_failing_mid_stream_is_resumed_elsewhere_without_gap_or_repeat(
    tokenizer: Tokenizer, redis_url: str, n: int, num_failures: int
) -> None:
    async def scenario() -> None:
        async with Router(tokenizer, redis_url) as router:
            a = await router.add_scheduler("a")
            b = await router.add_scheduler("b")
            a.fail_after_tokens = b.fail_after_tokens = 5  # whichever is picked fails
            a.failure_budget = b.failure_budget = [num_failures]
            responses = await router.generate(request(tokenizer, 8, n=n))
            calls = sorted(
                a.requests + b.requests, key=lambda r: sum(len(p.token_ids) for p in r.progress)
            )
            assert len(calls) == num_failures + 1 and not calls[0].progress
            samples = per_sample(responses, n)
            for i, (ids, text, reason) in enumerate(samples):
                assert ids == expected(tokenizer, 8, i), "a gap or a repeat"
                assert text == tokenizer.decode(ids) and reason == LENGTH
            for k, resumed in enumerate(calls[1:], start=1):
                # Each resume carries exactly what was delivered so far: 5 tokens per attempt.
                assert sum(len(p.token_ids) for p in resumed.progress) == 5 * k
                for i, progress in enumerate(resumed.progress):
                    assert progress.index == i and not progress.finished
                    assert list(progress.token_ids) == samples[i][0][: len(progress.token_ids)]
            assert responses[-1].usage.completion_tokens == 8 * n
            assert router.dispatcher._outstanding == {}, "every attempt gave its tokens back"

    run(scenario())


def test_the_failed_groups_replacement_takes_the_stream_back(
    tokenizer: Tokenizer, redis_url: str
) -> None:
    async def scenario() -> None:
        async with Router(tokenizer, redis_url) as router:
            old = await router.add_scheduler("g")
            old.fail_after_tokens, old.die = 3, True

            async def replace() -> None:
                await until(lambda: old.requests, 5)
                await asyncio.sleep(0.6)  # down for longer than the TTL
                await router.add_scheduler("g", wait=False)

            replacing = asyncio.create_task(replace())
            responses = await router.generate(request(tokenizer, 7))
            await replacing
            new = router.schedulers[-1]
            assert [len(p.token_ids) for p in new.requests[0].progress] == [3]
            assert per_sample(responses, 1)[0][0] == expected(tokenizer, 7)

    run(scenario())


def test_a_fresh_request_fails_over_before_its_first_token(
    tokenizer: Tokenizer, redis_url: str
) -> None:
    async def scenario() -> None:
        async with Router(tokenizer, redis_url) as router:
            a = await router.add_scheduler("a")
            b = await router.add_scheduler("b")
            a.fail_after_tokens = b.fail_after_tokens = 0
            responses = await router.generate(request(tokenizer, 4))
            assert per_sample(responses, 1)[0][0] == expected(tokenizer, 4)
            assert not any(r.progress for s in (a, b) for r in s.requests)

    run(scenario())


@pytest.mark.parametrize(
    "code", [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED]
)
def test_a_final_status_reaches_the_client_unretried(
    tokenizer: Tokenizer, redis_url: str, code: grpc.StatusCode
) -> None:
    async def scenario() -> None:
        async with Router(tokenizer, redis_url) as router:
            a = await router.add_scheduler("a")
            a.fail_after_tokens, a.fail_code = 2, code
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await router.generate(request(tokenizer, 6))
            assert info.value.code() == code and len(a.requests) == 1

    run(scenario())


def test_no_group_coming_back_within_the_resume_timeout_is_unavailable(
    tokenizer: Tokenizer, redis_url: str
) -> None:
    async def scenario() -> None:
        async with Router(tokenizer, redis_url, ResumeConfig(timeout_s=0.8)) as router:
            a = await router.add_scheduler("a")
            a.fail_after_tokens, a.die = 2, True
            started = asyncio.get_running_loop().time()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await router.generate(request(tokenizer, 6))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "took it back within --resume-timeout-s 0.8" in info.value.details()
            assert 0.7 < asyncio.get_running_loop().time() - started < 5
            assert router.dispatcher._outstanding == {}, "every attempt gave its tokens back"

    run(scenario())


# --- resume on a new router (resume_from) -----------------------------------------------


async def save_checkpoint(
    router: Router,
    request_id: str,
    samples: list[SampleState],
    state: str,
    max_tokens: int,
    stop: list[str] = (),
    n: int = 1,
    num_logprobs: int | None = None,
) -> None:
    validated = ValidatedRequest(
        tokenizer_prompt(router.tokenizer),
        SamplingOptions(seed=SEED),
        StoppingOptions(max_tokens=max_tokens, stop=list(stop)),
        num_logprobs,
        n=n,
    )
    mesh_id = router.generation.tenancy.mesh_request_id("", request_id)  # keys off: no owner
    submit = convert.submit_request(Submission.fresh(mesh_id, validated, 0))
    assert list(submit.stopping.stop) == list(stop), "stop strings must travel in the SubmitRequest"
    await router.registry.checkpoints.save(
        [Checkpoint(mesh_id, "a", submit.SerializeToString(), samples, state)], ttl_s=30
    )


def tokenizer_prompt(tokenizer: Tokenizer) -> list[int]:
    return tokenizer.encode("Hello world")


@pytest.mark.parametrize("num_known,resume_from", [(4, 2), (4, 4), (4, 6), (0, 3)])
def test_resume_from_continues_a_checkpointed_stream(
    tokenizer: Tokenizer, redis_url: str, num_known: int, resume_from: int
) -> None:
    async def scenario() -> None:
        async with Router(tokenizer, redis_url) as router:
            a = await router.add_scheduler("a")
            full = expected(tokenizer, 9)
            await save_checkpoint(router, "r1", [SampleState(full[:num_known])], ORPHANED, 9)
            resume = generate_pb2.GenerateRequest(request_id="r1", resume_from=resume_from)
            responses = await router.generate(resume)
            ids, text, reason = per_sample(responses, 1)[0]
            assert ids == full[resume_from:] and reason == LENGTH
            assert tokenizer.decode(full[:resume_from]) + text == tokenizer.decode(full)
            assert [list(p.token_ids) for p in a.requests[0].progress] == [full[:num_known]]
            assert responses[-1].usage.completion_tokens == 9
            assert responses[-1].usage.prompt_tokens == len(tokenizer_prompt(tokenizer))

    run(scenario())


def test_resume_from_a_finished_checkpoint_replays_and_keeps_stop_strings(
    tokenizer: Tokenizer, redis_url: str
) -> None:
    async def scenario() -> None:
        async with Router(tokenizer, redis_url) as router:
            a = await router.add_scheduler("a")
            full = expected(tokenizer, 12)
            text = tokenizer.decode(full)
            stop = text[len(tokenizer.decode(full[:6])) :][:3]  # starts inside token 7's text
            cut = text.index(stop)
            await save_checkpoint(router, "fin", [SampleState(full[:5], True, LENGTH)], FINISHED, 5)
            responses = await router.generate(
                generate_pb2.GenerateRequest(request_id="fin", resume_from=2)
            )
            assert per_sample(responses, 1)[0] == (full[2:5], tokenizer.decode(full[2:5]), LENGTH)
            assert not a.requests, "a finished checkpoint needs no scheduler"
            # A stop string checkpointed in the SubmitRequest ends the resumed stream right.
            await save_checkpoint(
                router, "stop", [SampleState(full[:4])], ORPHANED, 12, stop=[stop]
            )
            responses = await router.generate(
                generate_pb2.GenerateRequest(request_id="stop", resume_from=3)
            )
            ids, resumed_text, reason = per_sample(responses, 1)[0]
            assert reason == STOP and tokenizer.decode(full[:3]) + resumed_text == text[:cut]
            assert [list(p.token_ids) for p in a.requests[0].progress] == [full[:4]]

    run(scenario())


def test_resume_from_with_several_samples_treats_each_on_its_own(
    tokenizer: Tokenizer, redis_url: str
) -> None:
    async def scenario() -> None:
        async with Router(tokenizer, redis_url) as router:
            a = await router.add_scheduler("a")
            full = [expected(tokenizer, 5, i) for i in range(2)]
            samples = [SampleState(full[0], True, LENGTH), SampleState(full[1][:2])]
            await save_checkpoint(router, "n2", samples, ORPHANED, 5, n=2)
            responses = await router.generate(
                generate_pb2.GenerateRequest(request_id="n2", resume_from=3)
            )
            got = per_sample(responses, 2)
            assert [ids for ids, _, _ in got] == [full[0][3:], full[1][3:]]  # sample 1 skipped one
            assert [reason for _, _, reason in got] == [LENGTH, LENGTH]
            progress = a.requests[0].progress
            assert [(list(p.token_ids), p.finished) for p in progress] == [
                (full[0], True),
                (full[1][:2], False),
            ]
            assert responses[-1].usage.completion_tokens == 10

    run(scenario())


def stored_logprobs(
    token_ids: list[int], num_top: int
) -> list[tuple[float, list[tuple[int, float]]]]:
    """Made-up logprobs, exact in float32 as the wire carries them."""
    return [
        (
            -0.25 * (p + 1),
            [(token_ids[p] if i == 0 else i, -0.25 * (p + 1) - 0.5 * i) for i in range(num_top)],
        )
        for p in range(len(token_ids))
    ]


def replayed_logprobs(
    responses: list[generate_pb2.GenerateResponse], num_tokens: int
) -> list[tuple[float, list[tuple[int, float]]]]:
    """The logprobs of the first `num_tokens` tokens the client got."""
    got = [
        (lp.logprob, [(t.token_id, t.logprob) for t in lp.top])
        for r in responses
        for lp in r.logprobs
    ]
    assert len(got) >= num_tokens, "replayed tokens came without logprobs"
    return got[:num_tokens]


def test_replayed_tokens_carry_their_checkpointed_logprobs(
    tokenizer: Tokenizer, redis_url: str
) -> None:
    async def scenario() -> None:
        async with Router(tokenizer, redis_url) as router:
            a = await router.add_scheduler("a")
            full = expected(tokenizer, 9)
            logprobs = stored_logprobs(full[:6], 3)
            await save_checkpoint(
                router,
                "lp",
                [SampleState(full[:6], logprobs=logprobs)],
                ORPHANED,
                9,
                num_logprobs=3,
            )
            responses = await router.generate(
                generate_pb2.GenerateRequest(request_id="lp", resume_from=2)
            )
            assert per_sample(responses, 1)[0][0] == full[2:]
            assert replayed_logprobs(responses, 4) == logprobs[2:]
            texts = [t.token for r in responses for lp in r.logprobs for t in lp.top]
            assert texts[0] == tokenizer.decode([full[2]]), "the alternatives' texts come along"
            # The resubmitted progress carries them on, for the next checkpoint.
            progress = a.requests[0].progress[0]
            assert list(progress.token_ids) == full[:6]
            assert [
                (lp.logprob, [(t.token_id, t.logprob) for t in lp.top]) for lp in progress.logprobs
            ] == logprobs

            # A record written before logprobs were kept: its tokens replay without them.
            await save_checkpoint(
                router, "old", [SampleState(full[:6])], ORPHANED, 9, num_logprobs=3
            )
            responses = await router.generate(
                generate_pb2.GenerateRequest(request_id="old", resume_from=2)
            )
            assert per_sample(responses, 1)[0][0] == full[2:]
            assert not any(r.logprobs for r in responses)
            assert not a.requests[1].progress[0].logprobs

    run(scenario())


def test_the_logprobs_a_stream_delivered_travel_with_its_progress(tokenizer: Tokenizer) -> None:
    validated = ValidatedRequest(
        [1, 2], SamplingOptions(seed=SEED), StoppingOptions(max_tokens=9), 2, n=2
    )
    submission = Submission.fresh("r", validated, 0)
    progress = Progress.fresh(2)
    progress.record(
        0, [5, 6], False, [(-0.5, [(5, -0.5), (1, -1.0)]), (-0.25, [(6, -0.25), (2, -2.0)])]
    )
    progress.record(1, [7], False, [])  # its logprobs are not known: none are sent
    sent = convert.submit_request(submission, progress).progress
    assert [
        (lp.logprob, [(t.token_id, t.logprob) for t in lp.top]) for lp in sent[0].logprobs
    ] == progress.samples[0].logprobs
    assert list(sent[1].token_ids) == [7] and not sent[1].logprobs
    without = Submission.fresh("r", dataclasses.replace(validated, num_logprobs=None), 0)
    assert not any(p.logprobs for p in convert.submit_request(without, progress).progress)


def test_resume_from_an_unknown_request_is_not_found_and_zero_is_a_new_request(
    tokenizer: Tokenizer, redis_url: str
) -> None:
    async def scenario() -> None:
        async with Router(tokenizer, redis_url) as router:
            await router.add_scheduler("a")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await router.generate(
                    generate_pb2.GenerateRequest(request_id="nope", resume_from=3)
                )
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
            assert "finished" in info.value.details() and "expired" in info.value.details()
            fresh = request(tokenizer, 3, request_id="nope")
            assert per_sample(await router.generate(fresh), 1)[0][0] == expected(tokenizer, 3)

    run(scenario())


def test_a_new_request_of_the_http_api_looks_up_no_checkpoint(
    tokenizer: Tokenizer, redis_url: str
) -> None:
    """The HTTP API makes its request ids up (`new_request=True`): even an id that has a
    checkpoint is a new request there, and Redis is not asked."""

    async def scenario() -> None:
        async with Router(tokenizer, redis_url) as router:
            await router.add_scheduler("a")
            full = expected(tokenizer, 9)
            await save_checkpoint(router, "same-id", [SampleState(full[:4])], ORPHANED, 9)
            loads = []
            store = router.registry.checkpoints
            original = store.load
            store.load = lambda request_id: loads.append(request_id) or original(request_id)
            fresh = dataclasses.replace(
                convert.generation_request(request(tokenizer, 3, request_id="same-id")),
                new_request=True,
            )
            chunks = [c async for batch in router.generation.generate(fresh) for c in batch]
            assert [t for c in chunks for t in c.token_ids] == expected(
                tokenizer, 3
            )  # not the replay
            assert loads == []

    run(scenario())


# --- checkpoint deletion ---------------------------------------------------------------


def test_the_checkpoint_is_deleted_after_the_last_response_but_not_on_cancel(
    tokenizer: Tokenizer, redis_url: str
) -> None:
    async def scenario() -> None:
        async with Router(tokenizer, redis_url) as router:
            a = await router.add_scheduler("a")
            a.write_checkpoints = True
            store = router.registry.checkpoints

            def mesh_id(request_id: str) -> str:  # checkpoints are by the mesh's id
                return router.generation.tenancy.mesh_request_id("", request_id)

            await router.generate(request(tokenizer, 4, request_id="done"))
            await until(lambda: a.requests)
            for _ in range(100):
                if await store.load(mesh_id("done")) is None:
                    break
                await asyncio.sleep(0.02)
            assert await store.load(mesh_id("done")) is None
            assert mesh_id("done") not in await router.registry._redis.smembers(
                store.group_key("a")
            )

            # A stop string ends it while its scheduler still runs: deleted all the same.
            text = tokenizer.decode(expected(tokenizer, 12))
            stopped = await router.generate(
                request(tokenizer, 12, request_id="cut", stop=[text[8:11]])
            )
            assert stopped[-1].finish_reason == STOP
            for _ in range(100):
                if await store.load(mesh_id("cut")) is None:
                    break
                await asyncio.sleep(0.02)
            assert await store.load(mesh_id("cut")) is None

            a.delay_s = 0.1
            call = router.stub.Generate(request(tokenizer, 50, request_id="gone"))
            async for _ in call:
                break
            call.cancel()
            await asyncio.sleep(0.3)
            ckpt = await store.load(mesh_id("gone"))
            assert ckpt is not None and ckpt.state == RUNNING  # left for the client to resume

    run(scenario())


# --- groups' health ---------------------------------------------------------------------


def test_health_follows_ready_groups_and_degraded_ones_are_a_fallback(
    tokenizer: Tokenizer, redis_url: str
) -> None:
    serving, not_serving = (
        health_pb2.HealthCheckResponse.SERVING,
        health_pb2.HealthCheckResponse.NOT_SERVING,
    )

    async def health_becomes(router: Router, status: int) -> None:
        for _ in range(100):  # within a poll or two (0.05 s each) plus a heartbeat (0.1 s)
            if await router.health() == status:
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"health is not {status}")

    async def scenario() -> None:
        async with Router(tokenizer, redis_url) as router:
            assert await router.health() == not_serving
            a = await router.add_scheduler("a")
            await health_becomes(router, serving)
            a.status = "degraded"
            await health_becomes(router, not_serving)
            responses = await router.generate(request(tokenizer, 2))  # queued there all the same
            assert per_sample(responses, 1)[0][0] == expected(tokenizer, 2)
            b = await router.add_scheduler("b")
            await health_becomes(router, serving)
            responses = await router.generate(request(tokenizer, 2))
            assert len(b.requests) == 1 and len(a.requests) == 1, "ready groups come first"
            b.status = "draining"
            await health_becomes(router, not_serving)
            a.status = "ready"
            await health_becomes(router, serving)
            for _ in range(3):
                await router.generate(request(tokenizer, 2))
            assert len(b.requests) == 1, "a draining group is never picked"

    run(scenario())


def test_a_schedulers_own_health_counts_before_its_registry_entry_does(
    tokenizer: Tokenizer, redis_url: str
) -> None:
    serving, not_serving = (
        health_pb2.HealthCheckResponse.SERVING,
        health_pb2.HealthCheckResponse.NOT_SERVING,
    )

    async def scenario() -> None:
        async with Router(tokenizer, redis_url, ttl_s=3.0) as router:
            a = await router.add_scheduler("a")
            await until(lambda: router.directory.serving)
            await a.server.set_serving(False)  # its registry entry still says "ready"
            await until(lambda: not router.directory.serving, 1.0)
            assert await router.health() == not_serving
            await a.server.set_serving(True)
            await until(lambda: router.directory.serving, 1.0)
            assert await router.health() == serving
            await a.kill()  # unreachable: not ready long before its entry expires
            await until(lambda: not router.directory.serving, 1.0)
            assert "a" in await router.registry.list("scheduler")  # its entry lives on

    run(scenario())


def test_a_group_missing_from_one_poll_is_kept_until_the_ttl_passes(
    tokenizer: Tokenizer, redis_url: str
) -> None:
    async def scenario() -> None:
        async with Router(tokenizer, redis_url) as router:
            router.directory_task.cancel()  # polls by hand
            a = await router.add_scheduler("a", wait=False)
            await router.directory.refresh()
            assert router.directory.serving
            for task in a.registry._heartbeats:
                task.cancel()
            await a.registry.remove("scheduler", "a")  # as after a Redis restart
            await router.directory.refresh()
            assert [g.scheduler_id for g in router.directory.groups] == ["a"]
            assert router.directory.serving
            assert router.directory.num_groups == 0  # as a replica count: not in the registry now
            responses = await router.generate(request(tokenizer, 2))  # still routed there
            assert per_sample(responses, 1)[0][0] == expected(tokenizer, 2)
            await asyncio.sleep(router.registry.config.ttl_s + 0.05)
            await router.directory.refresh()
            assert not router.directory.groups and not router.directory.serving

    run(scenario())


# --- the retry policy, pure ------------------------------------------------------------


def test_retry_policy_classifies_and_backs_off() -> None:
    assert retry_kind(grpc.StatusCode.UNAVAILABLE) == "peer_gone"
    assert retry_kind(grpc.StatusCode.INTERNAL) == "suspect" and retry_kind(None) == "suspect"
    for code in (
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.FAILED_PRECONDITION,
    ):
        assert retry_kind(code) is None
    now = [0.0]
    attempts = Attempts(
        ResumeConfig(timeout_s=10, initial_backoff_s=0.5, max_backoff_s=2, max_suspect_retries=1),
        lambda: now[0],
        started=False,
    )
    assert not attempts.may_wait
    assert attempts.failed("a", grpc.StatusCode.UNAVAILABLE) is None
    assert attempts.may_wait and attempts.excluded == {"a"}
    assert [attempts.next_backoff_s() for _ in range(4)] == [0.5, 1, 2, 2]
    assert attempts.failed("a", grpc.StatusCode.INTERNAL) is None
    assert attempts.failed("a", grpc.StatusCode.INTERNAL) is not None  # twice in a row: a bug
    attempts.progressed()
    assert attempts.excluded == frozenset() and attempts.failed("b", None) is None
    now[0] = 10.5
    assert "within --resume-timeout-s 10" in attempts.failed("b", grpc.StatusCode.UNAVAILABLE)
