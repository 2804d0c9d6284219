"""The router's multiplexed stream (`Scheduler.Connect`) on a real scheduler servicer over
real gRPC, its engine loop driving a tiny model in-process (`InprocExecutor`): many
requests on one stream, one message per step, in-band errors, aborts, flow control."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pagemesh.runtime.serving import GrpcServer, ServerConfig
from pagemesh.tools.testing.tiny_models import write_tiny_model
from protos.pagemesh.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from protos.pagemesh.v1 import generate_pb2
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.engine_loop import EngineLoop
from scheduler_svc.executor import InprocExecutor
from scheduler_svc.servicer import SchedulerServicer

torch = pytest.importorskip("torch")

from worker_svc.runner import ModelRunner  # noqa: E402
from worker_svc.runner_config import RunnerConfig  # noqa: E402


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    model = write_tiny_model(tmp_path_factory.mktemp("connect") / "llama", "llama", seed=5)
    return ModelRunner.from_config(
        RunnerConfig(model_path=str(model), dtype="float32", num_blocks=512)
    )


class Scheduled:
    """A scheduler servicer serving over gRPC, with its engine loop running."""

    def __init__(self, runner: ModelRunner, max_buffered_tokens: int = 1 << 20) -> None:
        info = runner.info()
        runner.reset_requests()
        config = SchedulerConfig(
            num_blocks=info.num_blocks,
            block_size=info.block_size,
            max_num_batched_tokens=2048,
            max_num_seqs=128,
            max_model_len=info.max_model_len,
        )
        self.loop = EngineLoop(Scheduler(config), InprocExecutor(runner.execute_step))
        model_info = generate_pb2.GetModelInfoResponse(model="tiny", eos_token_ids=[0])
        self.servicer = SchedulerServicer(
            self.loop, model_info, max_buffered_tokens=max_buffered_tokens
        )
        self.steps = 0
        self.loop.on_step.append(self._count)

    def _count(self) -> None:
        self.steps += 1

    async def __aenter__(self) -> Scheduled:
        self.server = GrpcServer(
            ServerConfig(),
            [],
            [lambda s: scheduler_pb2_grpc.add_SchedulerServicer_to_server(self.servicer, s)],
        )
        await self.server.start()
        self.task = asyncio.create_task(self.loop.run())
        self.channel = grpc.aio.insecure_channel(self.server.address)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.channel.close()
        await self.server.server.stop(0)
        self.task.cancel()
        await self.loop.workers.close()


def submit(
    request_id: str, max_tokens: int, prompt: list[int] | None = None, **kwargs: object
) -> scheduler_pb2.SubmitRequest:
    return scheduler_pb2.SubmitRequest(
        request_id=request_id,
        prompt_token_ids=[5, 9, 11, 200, 7] if prompt is None else prompt,
        sampling=generate_pb2.SamplingParams(temperature=0.0, seed=1),
        stopping=generate_pb2.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
        **kwargs,
    )


def up(message: scheduler_pb2.SubmitRequest | str) -> scheduler_pb2.ConnectRequest:
    if isinstance(message, str):
        return scheduler_pb2.ConnectRequest(abort=scheduler_pb2.AbortRequest(request_id=message))
    return scheduler_pb2.ConnectRequest(submit=message)


async def collect(call, num_requests: int) -> tuple[dict, dict, int]:
    """Reads until `num_requests` submits ended, by a last output or an error: (tokens per
    id, error per id, messages)."""
    tokens: dict[str, list[int]] = {}
    errors: dict[str, tuple[grpc.StatusCode, str]] = {}
    num_ended = 0
    num_messages = 0
    while num_ended < num_requests:
        message = await asyncio.wait_for(call.read(), 30)
        num_messages += 1
        for output in message.outputs:
            tokens.setdefault(output.request_id, []).extend(output.token_ids)
            if output.finish_reason:
                num_ended += 1
        for error in message.errors:
            code = next(c for c in grpc.StatusCode if c.value[0] == error.code)
            errors[error.request_id] = (code, error.message)
            num_ended += 1
    return tokens, errors, num_messages


def test_many_requests_share_one_stream_and_one_message_per_step(runner: ModelRunner) -> None:
    async def scenario() -> None:
        async with Scheduled(runner) as scheduled:
            alone = [list(r.token_ids) async for r in scheduled.stub.Submit(submit("alone", 12))]
            steps_before = scheduled.steps
            call = scheduled.stub.Connect()
            for i in range(16):
                await call.write(up(submit(f"r{i}", 12)))
            tokens, errors, num_messages = await collect(call, 16)
            await call.done_writing()
            assert errors == {}
            assert all(ids == [t for chunk in alone for t in chunk] for ids in tokens.values())
            # Per step, not per token: 16 x 12 tokens in about one message per step.
            assert num_messages <= scheduled.steps - steps_before + 1 < 16 * 12 / 4
            assert await call.read() == grpc.aio.EOF  # half-closed and nothing open: it ends

    asyncio.run(scenario())


def test_a_bad_submit_fails_alone_in_band(runner: ModelRunner) -> None:
    async def scenario() -> None:
        async with Scheduled(runner) as scheduled:
            call = scheduled.stub.Connect()
            await call.write(up(submit("good-1", 8)))
            await call.write(up(submit("bad", 8, progress=[scheduler_pb2.SampleProgress(index=3)])))
            await call.write(up(submit("no-prompt", 8, prompt=[])))
            await call.write(up(submit("good-1", 8)))  # already streaming here
            await call.write(up(submit("good-2", 8)))
            tokens, errors, _ = await collect(call, 5)
            assert len(tokens["good-1"]) == 8 and len(tokens["good-2"]) == 8
            assert errors["no-prompt"][0] == grpc.StatusCode.INVALID_ARGUMENT
            assert "empty prompt" in errors["no-prompt"][1]
            assert errors["good-1"][0] == grpc.StatusCode.ALREADY_EXISTS
            assert errors["bad"][0] == grpc.StatusCode.INVALID_ARGUMENT
            assert "progress names sample 3" in errors["bad"][1]
            call.cancel()

    asyncio.run(scenario())


def test_an_abort_ends_one_request_and_the_stream_ending_aborts_the_rest(
    runner: ModelRunner,
) -> None:
    async def scenario() -> None:
        async with Scheduled(runner) as scheduled:
            call = scheduled.stub.Connect()
            await call.write(up(submit("long", 400)))
            await call.write(up(submit("short", 6)))
            await call.write(up(submit("other", 400)))
            got: dict[str, int] = {}
            while got.get("short", 0) < 6:
                message = await asyncio.wait_for(call.read(), 30)
                for output in message.outputs:
                    got[output.request_id] = got.get(output.request_id, 0) + len(output.token_ids)
            await call.write(up("long"))
            while "long" in scheduled.loop.scheduler.requests:
                await asyncio.sleep(0.01)
            assert "other" in scheduled.loop.scheduler.requests  # still running
            call.cancel()
            while scheduled.loop.scheduler.requests or scheduled.servicer.connections:
                await asyncio.sleep(0.01)

    asyncio.run(scenario())


def test_a_router_that_never_reads_is_cut_off_with_bounded_memory(runner: ModelRunner) -> None:
    async def scenario() -> None:
        async with Scheduled(runner, max_buffered_tokens=2000) as scheduled:
            reader = scheduled.stub.Connect()
            await reader.write(up(submit("read-me", 300)))
            # Without BDP probing the receive window stays at its 64 KiB start.
            stuck_channel = grpc.aio.insecure_channel(
                scheduled.server.address, options=[("grpc.http2.bdp_probe", 0)]
            )
            stuck = scheduler_pb2_grpc.SchedulerStub(stuck_channel).Connect()
            for i in range(64):
                await stuck.write(up(submit(f"stuck-{i}", 400)))
            # The stuck stream never reads; the other one keeps reading to the end.
            tokens, errors, _ = await collect(reader, 1)
            while scheduled.servicer.connections and any(
                c.cut_off is None for c in scheduled.servicer.connections if c.num_open > 1
            ):
                await asyncio.sleep(0.05)
            assert len(tokens["read-me"]) == 300 and not errors
            with pytest.raises(grpc.aio.AioRpcError) as failure:
                while True:
                    await asyncio.wait_for(stuck.read(), 30)
            assert failure.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "cut off" in failure.value.details()
            while scheduled.loop.scheduler.requests:  # every stuck request was aborted
                await asyncio.sleep(0.05)
            await stuck_channel.close()

    asyncio.run(scenario())
