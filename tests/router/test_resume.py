"""Fault tolerance through a real router: streams resumed across scheduler failures, resume_from
on a fresh router, checkpoint deletion, groups' health.

Real gRPC on 127.0.0.1 and a real Valkey; the schedulers are scripted: each serves real gRPC,
heartbeats into the registry like a scheduler, and samples a deterministic function of
(seed, sample, position), so the undisturbed output is known in advance.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagemesh.checkpoints import FINISHED, ORPHANED, RUNNING, Checkpoint, SampleState
from pagemesh.registry import Registry, RegistryConfig
from pagemesh.serving import GrpcServer, ServerConfig
from protos.pagemesh.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from protos.pagemesh.v1 import generate_pb2, generate_pb2_grpc
from router import convert
from router.resume import Attempts, ResumeConfig, retry_kind
from router.scheduler_client import SchedulerPool
from router.servicer import GenerationServicer
from router.tokenizer import Tokenizer, load_tokenizer
from router.validation import SamplingOptions, StoppingOptions, ValidatedRequest
from tests.bpe_folder import write_bpe_folder

SERVICE = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
LENGTH = generate_pb2.FINISH_REASON_LENGTH
STOP = generate_pb2.FINISH_REASON_STOP
SEED = 11


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return load_tokenizer(str(write_bpe_folder(tmp_path_factory.mktemp("bpe"))))


def vocabulary(tokenizer: Tokenizer) -> list[int]:
    return tokenizer.encode("Hello world, the quick brown fox. cafe")


def expected(tokenizer: Tokenizer, max_tokens: int, index: int = 0, seed: int = SEED) -> list[int]:
    """What any undisturbed run samples: a function of (seed, sample, position) only."""
    pool = vocabulary(tokenizer)
    return [pool[(seed * 5 + (seed + index) * 3 + p) % len(pool)] for p in range(max_tokens)]


class ScriptedScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Samples `expected(...)`, honours `progress`, and fails on cue: after
    `fail_after_tokens` tokens of one call it aborts with `fail_code`, or with `die=True`
    stops its server (a SIGKILL: its registry entry lingers until the TTL)."""

    def __init__(self, tokenizer: Tokenizer, registry: Registry, scheduler_id: str) -> None:
        self.tokenizer = tokenizer
        self.registry = registry
        self.scheduler_id = scheduler_id
        self.status = "ready"
        self.requests: list[scheduler_pb2.SubmitRequest] = []
        self.fail_after_tokens: int | None = None
        self.failure_budget = [1]  # failures left; share the list to count across schedulers
        self.fail_code = grpc.StatusCode.UNAVAILABLE
        self.die = False
        self.write_checkpoints = False
        self.delay_s = 0.01
        self.server: GrpcServer | None = None

    async def start(self) -> None:
        self.server = GrpcServer(ServerConfig(), [], [
            lambda s: scheduler_pb2_grpc.add_SchedulerServicer_to_server(self, s)])
        await self.server.start()
        await self.server.set_serving(True)
        await self.registry.start_heartbeat("scheduler", self.scheduler_id, lambda: {
            "address": self.server.address, "group": self.scheduler_id, "status": self.status,
            "num_running": 0, "num_waiting": 0, "num_free_blocks": 100})

    async def kill(self) -> None:
        """Dies without a goodbye: heartbeats stop, connections drop."""
        for task in self.registry._heartbeats:
            task.cancel()
        await self.server.server.stop(0)

    async def GetModelInfo(self, request, context):
        return generate_pb2.GetModelInfoResponse(model="scripted", max_model_len=1024, vocab_size=300,
                                                 eos_token_ids=[2], block_size=16)

    async def Submit(self, request, context):
        self.requests.append(request)
        n = max(request.n, 1)
        outputs = {i: [] for i in range(n)}
        finished: set[int] = set()
        for p in request.progress:
            outputs[p.index] = list(p.token_ids)
            if p.finished:
                finished.add(p.index)
        num_sent = 0
        await self._checkpoint(request, outputs, finished, RUNNING)
        while len(finished) < n:
            for i in sorted(set(range(n)) - finished):
                if (self.fail_after_tokens is not None and num_sent >= self.fail_after_tokens
                        and self.failure_budget[0] > 0):
                    self.failure_budget[0] -= 1
                    if self.die:
                        asyncio.get_running_loop().create_task(self.kill())
                        await asyncio.sleep(10)
                    await context.abort(self.fail_code, "scripted failure")
                position = len(outputs[i])
                token = expected(self.tokenizer, position + 1, i, request.sampling.seed)[position]
                outputs[i].append(token)
                reason = LENGTH if len(outputs[i]) >= request.stopping.max_tokens else 0
                if reason:
                    finished.add(i)
                    state = FINISHED if len(finished) == n else RUNNING
                    await self._checkpoint(request, outputs, finished, state)
                num_sent += 1
                yield scheduler_pb2.SubmitResponse(index=i, token_ids=[token], finish_reason=reason)
                await asyncio.sleep(self.delay_s)

    async def _checkpoint(self, request, outputs, finished, state) -> None:
        if not self.write_checkpoints:
            return
        original = scheduler_pb2.SubmitRequest()
        original.CopyFrom(request)
        del original.progress[:]
        samples = [SampleState(list(outputs[i]), i in finished, LENGTH if i in finished else 0)
                   for i in sorted(outputs)]
        await self.registry.checkpoints.save([Checkpoint(
            request.request_id, self.scheduler_id, original.SerializeToString(), samples, state)])


@dataclass
class Router:
    """A real router (pool + GenerationServicer behind GrpcServer), wired like router.main."""

    tokenizer: Tokenizer
    redis_url: str
    resume: ResumeConfig = field(default_factory=ResumeConfig)
    ttl_s: float = 0.4  # of registry entries (heartbeats every quarter of it)
    cluster: str = field(default_factory=lambda: f"t-resume-{uuid.uuid4().hex[:8]}")
    schedulers: list[ScriptedScheduler] = field(default_factory=list)

    def registry_config(self) -> RegistryConfig:
        return RegistryConfig(self.redis_url, cluster=self.cluster,
                              heartbeat_interval_s=self.ttl_s / 4, ttl_s=self.ttl_s)

    async def __aenter__(self) -> Router:
        self.registry = Registry(self.registry_config())

        def on_change(serving: bool) -> None:
            asyncio.get_running_loop().create_task(self.server.set_serving(serving))

        self.pool = SchedulerPool(self.registry, 0.05, on_change, resume=self.resume)
        self.servicer = GenerationServicer(self.tokenizer, self.pool)
        self.server = GrpcServer(ServerConfig(), [SERVICE], [
            lambda s: generate_pb2_grpc.add_GenerationServicer_to_server(self.servicer, s)])
        await self.server.start()
        self.pool_task = asyncio.create_task(self.pool.run())
        self.channel = grpc.aio.insecure_channel(self.server.address)
        self.stub = generate_pb2_grpc.GenerationStub(self.channel)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.channel.close()
        self.pool_task.cancel()
        await self.server.server.stop(0)
        await self.pool.close()
        for scheduler in self.schedulers:
            await scheduler.server.server.stop(0)
            await scheduler.registry.close()
        await self.registry.close()

    async def add_scheduler(self, scheduler_id: str, wait: bool = True) -> ScriptedScheduler:
        scheduler = ScriptedScheduler(self.tokenizer, Registry(self.registry_config()), scheduler_id)
        await scheduler.start()
        self.schedulers.append(scheduler)
        if wait:
            await until(lambda: scheduler_id in self.pool._groups
                        and self.pool._groups[scheduler_id].address == scheduler.server.address)
        return scheduler

    async def generate(self, request: generate_pb2.GenerateRequest) -> list[generate_pb2.GenerateResponse]:
        return [r async for r in self.stub.Generate(request, timeout=20)]

    async def health(self) -> int:
        stub = health_pb2_grpc.HealthStub(self.channel)
        return (await stub.Check(health_pb2.HealthCheckRequest())).status


async def until(predicate, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def request(tokenizer: Tokenizer, max_tokens: int, **kwargs: object) -> generate_pb2.GenerateRequest:
    stop = kwargs.pop("stop", [])
    return generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=tokenizer.encode("Hello world")),
        sampling=generate_pb2.SamplingParams(seed=SEED),
        stopping=generate_pb2.StoppingCriteria(max_tokens=max_tokens, stop=stop), **kwargs)


def per_sample(responses: list[generate_pb2.GenerateResponse], n: int) -> list[tuple[list[int], str, int]]:
    out = [([], "", 0) for _ in range(n)]
    for r in responses:
        ids, text, reason = out[r.index]
        assert reason == 0, f"sample {r.index} got a message after its last one"
        out[r.index] = (ids + list(r.token_ids), text + r.text, r.finish_reason)
    return out


def run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, 25))


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
            calls = sorted(a.requests + b.requests, key=lambda r: sum(len(p.token_ids) for p in r.progress))
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
                    assert list(progress.token_ids) == samples[i][0][:len(progress.token_ids)]
            assert responses[-1].usage.completion_tokens == 8 * n
            assert set(router.pool._outstanding.values()) == {0}

    run(scenario())


def test_the_failed_groups_replacement_takes_the_stream_back(tokenizer: Tokenizer, redis_url: str) -> None:
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


def test_a_fresh_request_fails_over_before_its_first_token(tokenizer: Tokenizer, redis_url: str) -> None:
    async def scenario() -> None:
        async with Router(tokenizer, redis_url) as router:
            a = await router.add_scheduler("a")
            b = await router.add_scheduler("b")
            a.fail_after_tokens = b.fail_after_tokens = 0
            responses = await router.generate(request(tokenizer, 4))
            assert per_sample(responses, 1)[0][0] == expected(tokenizer, 4)
            assert not any(r.progress for s in (a, b) for r in s.requests)

    run(scenario())


@pytest.mark.parametrize("code", [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED])
def test_a_final_status_reaches_the_client_unretried(tokenizer: Tokenizer, redis_url: str,
                                                       code: grpc.StatusCode) -> None:
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
            assert set(router.pool._outstanding.values()) <= {0}

    run(scenario())


# --- resume on a new router (resume_from) -----------------------------------------------


async def save_checkpoint(router: Router, request_id: str, samples: list[SampleState], state: str,
                          max_tokens: int, stop: list[str] = (), n: int = 1) -> None:
    validated = ValidatedRequest(tokenizer_prompt(router.tokenizer), SamplingOptions(seed=SEED),
                                 StoppingOptions(max_tokens=max_tokens, stop=list(stop)), None, n=n)
    submit = convert.submit_request(request_id, validated, 0)
    assert list(submit.stopping.stop) == list(stop), "stop strings must travel in the SubmitRequest"
    await router.registry.checkpoints.save(
        [Checkpoint(request_id, "a", submit.SerializeToString(), samples, state)], ttl_s=30)


def tokenizer_prompt(tokenizer: Tokenizer) -> list[int]:
    return tokenizer.encode("Hello world")


@pytest.mark.parametrize("num_known,resume_from", [(4, 2), (4, 4), (4, 6), (0, 3)])
def test_resume_from_continues_a_checkpointed_stream(tokenizer: Tokenizer, redis_url: str,
                                                     num_known: int, resume_from: int) -> None:
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
            stop = text[len(tokenizer.decode(full[:6])):][:3]  # starts inside token 7's text
            cut = text.index(stop)
            await save_checkpoint(router, "fin", [SampleState(full[:5], True, LENGTH)], FINISHED, 5)
            responses = await router.generate(generate_pb2.GenerateRequest(request_id="fin", resume_from=2))
            assert per_sample(responses, 1)[0] == (full[2:5], tokenizer.decode(full[2:5]), LENGTH)
            assert not a.requests, "a finished checkpoint needs no scheduler"
            # A stop string checkpointed in the SubmitRequest ends the resumed stream right.
            await save_checkpoint(router, "stop", [SampleState(full[:4])], ORPHANED, 12, stop=[stop])
            responses = await router.generate(generate_pb2.GenerateRequest(request_id="stop", resume_from=3))
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
            responses = await router.generate(generate_pb2.GenerateRequest(request_id="n2", resume_from=3))
            got = per_sample(responses, 2)
            assert [ids for ids, _, _ in got] == [full[0][3:], full[1][3:]]  # sample 1 skipped one
            assert [reason for _, _, reason in got] == [LENGTH, LENGTH]
            progress = a.requests[0].progress
            assert [(list(p.token_ids), p.finished) for p in progress] == [
                (full[0], True), (full[1][:2], False)]
            assert responses[-1].usage.completion_tokens == 10

    run(scenario())


def test_resume_from_an_unknown_request_is_not_found_and_zero_is_a_new_request(
    tokenizer: Tokenizer, redis_url: str
) -> None:
    async def scenario() -> None:
        async with Router(tokenizer, redis_url) as router:
            await router.add_scheduler("a")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await router.generate(generate_pb2.GenerateRequest(request_id="nope", resume_from=3))
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
            assert "finished" in info.value.details() and "expired" in info.value.details()
            fresh = request(tokenizer, 3, request_id="nope")
            assert per_sample(await router.generate(fresh), 1)[0][0] == expected(tokenizer, 3)

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
            await router.generate(request(tokenizer, 4, request_id="done"))
            await until(lambda: a.requests)
            for _ in range(100):
                if await store.load("done") is None:
                    break
                await asyncio.sleep(0.02)
            assert await store.load("done") is None
            assert "done" not in await router.registry._redis.smembers(store.group_key("a"))

            # A stop string ends it while its scheduler still runs: deleted all the same.
            text = tokenizer.decode(expected(tokenizer, 12))
            stopped = await router.generate(request(tokenizer, 12, request_id="cut", stop=[text[8:11]]))
            assert stopped[-1].finish_reason == STOP
            for _ in range(100):
                if await store.load("cut") is None:
                    break
                await asyncio.sleep(0.02)
            assert await store.load("cut") is None

            a.delay_s = 0.1
            call = router.stub.Generate(request(tokenizer, 50, request_id="gone"))
            async for _ in call:
                break
            call.cancel()
            await asyncio.sleep(0.3)
            ckpt = await store.load("gone")
            assert ckpt is not None and ckpt.state == RUNNING  # left for the client to resume

    run(scenario())


# --- groups' health ---------------------------------------------------------------------


def test_health_follows_ready_groups_and_degraded_ones_are_a_fallback(
    tokenizer: Tokenizer, redis_url: str
) -> None:
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING

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
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING

    async def scenario() -> None:
        async with Router(tokenizer, redis_url, ttl_s=3.0) as router:
            a = await router.add_scheduler("a")
            await until(lambda: router.pool.serving)
            await a.server.set_serving(False)  # its registry entry still says "ready"
            await until(lambda: not router.pool.serving, 1.0)
            assert await router.health() == not_serving
            await a.server.set_serving(True)
            await until(lambda: router.pool.serving, 1.0)
            assert await router.health() == serving
            await a.kill()  # unreachable: not ready long before its entry expires
            await until(lambda: not router.pool.serving, 1.0)
            assert "a" in await router.registry.list("scheduler")  # its entry lives on

    run(scenario())


def test_a_group_missing_from_one_poll_is_kept_until_the_ttl_passes(
    tokenizer: Tokenizer, redis_url: str
) -> None:
    async def scenario() -> None:
        async with Router(tokenizer, redis_url) as router:
            router.pool_task.cancel()  # polls by hand
            a = await router.add_scheduler("a", wait=False)
            await router.pool.refresh()
            assert router.pool.serving
            for task in a.registry._heartbeats:
                task.cancel()
            await a.registry.remove("scheduler", "a")  # as after a Redis restart
            await router.pool.refresh()
            assert "a" in router.pool._groups and router.pool.serving
            assert router.pool.num_groups == 0  # as a replica count: not in the registry now
            responses = await router.generate(request(tokenizer, 2))  # still routed there
            assert per_sample(responses, 1)[0][0] == expected(tokenizer, 2)
            await asyncio.sleep(router.registry.config.ttl_s + 0.05)
            await router.pool.refresh()
            assert not router.pool._groups and not router.pool.serving

    run(scenario())


# --- the retry policy, pure ------------------------------------------------------------


def test_retry_policy_classifies_and_backs_off() -> None:
    assert retry_kind(grpc.StatusCode.UNAVAILABLE) == "peer_gone"
    assert retry_kind(grpc.StatusCode.INTERNAL) == "suspect" and retry_kind(None) == "suspect"
    for code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                 grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED,
                 grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.FAILED_PRECONDITION):
        assert retry_kind(code) is None
    now = [0.0]
    attempts = Attempts(ResumeConfig(timeout_s=10, initial_backoff_s=0.5, max_backoff_s=2,
                                     max_suspect_retries=1), lambda: now[0], started=False)
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
