"""A real router in-process with scripted schedulers: each serves real gRPC, heartbeats
into the registry like a scheduler, and samples a deterministic function of (seed, sample,
position), so the undisturbed output is known in advance. Shared by the router's resume
tests and the metrics and tracing tests that need a router whose groups fail on cue."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagemesh.runtime.checkpoints import FINISHED, RUNNING, Checkpoint, SampleState
from pagemesh.runtime.registry import Registry, RegistryConfig
from pagemesh.runtime.serving import GrpcServer, ServerConfig
from pagemesh.runtime.tokenizer import Tokenizer
from protos.pagemesh.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from protos.pagemesh.v1 import generate_pb2, generate_pb2_grpc
from router.dispatcher import Dispatcher
from router.generation import AdmissionLimits, Generation
from router.group_directory import GroupDirectory
from router.resume import ResumeConfig
from router.servicer import GenerationServicer
from router.tenancy import SECRET_NAME, Tenancy
from tests.support.eventually import eventually_async

SERVICE = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
LENGTH = generate_pb2.FINISH_REASON_LENGTH
STOP = generate_pb2.FINISH_REASON_STOP
SEED = 11


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
        self.server = GrpcServer(
            ServerConfig(),
            [],
            [lambda s: scheduler_pb2_grpc.add_SchedulerServicer_to_server(self, s)],
        )
        await self.server.start()
        await self.server.set_serving(True)
        await self.registry.start_heartbeat(
            "scheduler",
            self.scheduler_id,
            lambda: {
                "address": self.server.address,
                "group": self.scheduler_id,
                "status": self.status,
                "num_running": 0,
                "num_waiting": 0,
                "num_free_blocks": 100,
            },
        )

    async def kill(self) -> None:
        """Dies without a goodbye: heartbeats stop, connections drop."""
        for task in self.registry._heartbeats:
            task.cancel()
        await self.server.server.stop(0)

    async def GetModelInfo(self, request, context):
        return generate_pb2.GetModelInfoResponse(
            model="scripted", max_model_len=1024, vocab_size=300, eos_token_ids=[2], block_size=16
        )

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
                if (
                    self.fail_after_tokens is not None
                    and num_sent >= self.fail_after_tokens
                    and self.failure_budget[0] > 0
                ):
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

    async def Connect(self, request_iterator, context):
        """The router's multiplexed stream, served by running `Submit` per request: its
        `context.abort` becomes that request's in-band error; `die` breaks the stream."""
        out: asyncio.Queue[scheduler_pb2.ConnectResponse] = asyncio.Queue()
        running: dict[str, asyncio.Task[None]] = {}

        async def serve(submit: scheduler_pb2.SubmitRequest) -> None:
            try:
                async for response in self.Submit(
                    submit, _InBandContext(dict(submit.trace_context))
                ):
                    response.request_id = submit.request_id
                    out.put_nowait(scheduler_pb2.ConnectResponse(outputs=[response]))
            except _InBandAbort as exc:
                out.put_nowait(
                    scheduler_pb2.ConnectResponse(
                        errors=[
                            scheduler_pb2.RequestError(
                                request_id=submit.request_id,
                                code=exc.code.value[0],
                                message=exc.details,
                            )
                        ]
                    )
                )

        async def read() -> None:
            async for message in request_iterator:
                if message.HasField("submit"):
                    running[message.submit.request_id] = asyncio.create_task(serve(message.submit))
                elif message.HasField("abort") and message.abort.request_id in running:
                    running.pop(message.abort.request_id).cancel()

        reader = asyncio.create_task(read())
        try:
            while True:
                yield await out.get()
        finally:
            reader.cancel()
            for task in running.values():
                task.cancel()

    async def _checkpoint(self, request, outputs, finished, state) -> None:
        if not self.write_checkpoints:
            return
        original = scheduler_pb2.SubmitRequest()
        original.CopyFrom(request)
        del original.progress[:]
        samples = [
            SampleState(list(outputs[i]), i in finished, LENGTH if i in finished else 0)
            for i in sorted(outputs)
        ]
        await self.registry.checkpoints.save(
            [
                Checkpoint(
                    request.request_id,
                    self.scheduler_id,
                    original.SerializeToString(),
                    samples,
                    state,
                )
            ]
        )


class _InBandAbort(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _InBandContext:
    """What `Submit` needs of a servicer context when it runs inside `Connect`: the
    request's trace context stands for the call's metadata."""

    def __init__(self, trace_context: dict[str, str]) -> None:
        self._metadata = tuple(trace_context.items())

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _InBandAbort(code, details)


@dataclass
class Router:
    """A real router (directory + dispatcher + Generation + its GenerationServicer behind
    GrpcServer), wired like
    router.main."""

    tokenizer: Tokenizer
    redis_url: str
    resume: ResumeConfig = field(default_factory=ResumeConfig)
    ttl_s: float = 0.4  # of registry entries (heartbeats every quarter of it)
    cluster: str = field(default_factory=lambda: f"t-resume-{uuid.uuid4().hex[:8]}")
    schedulers: list[ScriptedScheduler] = field(default_factory=list)
    limits: AdmissionLimits = field(default_factory=AdmissionLimits)

    def registry_config(self) -> RegistryConfig:
        return RegistryConfig(
            self.redis_url,
            cluster=self.cluster,
            heartbeat_interval_s=self.ttl_s / 4,
            ttl_s=self.ttl_s,
        )

    async def __aenter__(self) -> Router:
        self.registry = Registry(self.registry_config())

        def on_change(serving: bool) -> None:
            asyncio.get_running_loop().create_task(self.server.set_serving(serving))

        self.directory = GroupDirectory(self.registry, 0.05, on_change)
        self.dispatcher = Dispatcher(self.directory, resume=self.resume)
        tenancy = Tenancy(await self.registry.shared_secret(SECRET_NAME))  # as router/main.py
        self.generation = Generation(self.tokenizer, self.dispatcher, self.limits, tenancy=tenancy)
        self.servicer = GenerationServicer(self.generation)
        self.server = GrpcServer(
            ServerConfig(),
            [SERVICE],
            [lambda s: generate_pb2_grpc.add_GenerationServicer_to_server(self.servicer, s)],
        )
        await self.server.start()
        self.directory_task = asyncio.create_task(self.directory.run())
        self.channel = grpc.aio.insecure_channel(self.server.address)
        self.stub = generate_pb2_grpc.GenerationStub(self.channel)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.channel.close()
        self.directory_task.cancel()
        await self.server.server.stop(0)
        await self.directory.close()
        for scheduler in self.schedulers:
            await scheduler.server.server.stop(0)
            await scheduler.registry.close()
        await self.registry.close()

    async def add_scheduler(self, scheduler_id: str, wait: bool = True) -> ScriptedScheduler:
        scheduler = ScriptedScheduler(
            self.tokenizer, Registry(self.registry_config()), scheduler_id
        )
        await scheduler.start()
        self.schedulers.append(scheduler)
        if wait:
            await until(
                lambda: any(
                    g.scheduler_id == scheduler_id and g.address == scheduler.server.address
                    for g in self.directory.groups
                )
            )
        return scheduler

    async def generate(
        self, request: generate_pb2.GenerateRequest
    ) -> list[generate_pb2.GenerateResponse]:
        return [r async for r in self.stub.Generate(request, timeout=20)]

    async def health(self) -> int:
        stub = health_pb2_grpc.HealthStub(self.channel)
        return (await stub.Check(health_pb2.HealthCheckRequest())).status


async def until(predicate, timeout_s: float = 5.0) -> None:
    await eventually_async(predicate, timeout_s, "condition not met in time")


def request(
    tokenizer: Tokenizer, max_tokens: int, **kwargs: object
) -> generate_pb2.GenerateRequest:
    stop = kwargs.pop("stop", [])
    return generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=tokenizer.encode("Hello world")),
        sampling=generate_pb2.SamplingParams(seed=SEED),
        stopping=generate_pb2.StoppingCriteria(max_tokens=max_tokens, stop=stop),
        **kwargs,
    )


def per_sample(
    responses: list[generate_pb2.GenerateResponse], n: int
) -> list[tuple[list[int], str, int]]:
    out = [([], "", 0) for _ in range(n)]
    for r in responses:
        ids, text, reason = out[r.index]
        assert reason == 0, f"sample {r.index} got a message after its last one"
        out[r.index] = (ids + list(r.token_ids), text + r.text, r.finish_reason)
    return out


def run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, 25))
