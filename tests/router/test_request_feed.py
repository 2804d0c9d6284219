"""The router's per-step pass: a step's message reaches every request in one pass, each
request's task wakes once per step with everything of that step, and one request's failure
(in-band, or a bug in its processing) never touches the others."""

import asyncio

import grpc
import pytest

from protos.pagemesh.scheduler.v1 import scheduler_pb2
from router.request_feed import RequestFeed
from router.resume import Attempts, Progress, ResumeConfig
from router.scheduler_stream import OpenRequest, _dispatch, _Session, rpc_error
from router.types import FinishReason, SampleOutput

STOP, LENGTH = 1, 2  # the wire's FinishReason values


def output(request_id: str, index: int, token_ids: list[int], finish_reason: int = 0):
    return scheduler_pb2.SubmitResponse(
        request_id=request_id, index=index, token_ids=token_ids, finish_reason=finish_reason
    )


def sample(index: int, token_ids: list[int], finish_reason: FinishReason | None = None):
    """A scheduler output as the stream hands it to a feed (converted once, in `_dispatch`)."""
    return SampleOutput(index, token_ids, finish_reason)


def message(*outputs, errors=()):
    return scheduler_pb2.ConnectResponse(outputs=list(outputs), errors=list(errors))


class Recorder:
    """A RequestSink that logs every call."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def add(self, out) -> None:
        self.calls.append(("add", out.index, list(out.token_ids)))

    def flush(self) -> None:
        self.calls.append(("flush",))

    def fail(self, error) -> None:
        self.calls.append(("fail", error.code()))


def open_requests(**num_samples: int) -> tuple[dict[str, OpenRequest], dict[str, Recorder]]:
    session, sinks = _Session(), {}
    for request_id, n in num_samples.items():
        sinks[request_id] = Recorder()
        session.requests[request_id] = OpenRequest(request_id, sinks[request_id], session, n)
    return session.requests, sinks


def test_one_flush_per_request_per_message_after_all_its_outputs():
    requests, sinks = open_requests(a=2, b=1)
    _dispatch(message(output("a", 0, [5]), output("b", 0, [7]), output("a", 1, [6])), requests)
    assert sinks["a"].calls == [("add", 0, [5]), ("add", 1, [6]), ("flush",)]
    assert sinks["b"].calls == [("add", 0, [7]), ("flush",)]
    assert set(requests) == {"a", "b"}


def test_a_request_leaves_once_the_scheduler_finished_every_sample():
    requests, sinks = open_requests(a=2, b=1)
    _dispatch(message(output("a", 0, [5], LENGTH), output("b", 0, [7], STOP)), requests)
    assert set(requests) == {"a"}  # b's only sample finished; a has one more to go
    _dispatch(message(output("a", 1, [6], LENGTH), output("b", 0, [9])), requests)
    assert requests == {}
    assert sinks["b"].calls == [("add", 0, [7]), ("flush",)]  # nothing after its end


def test_in_band_error_fails_its_request_alone_after_the_steps_outputs():
    requests, sinks = open_requests(a=1, b=1)
    error = scheduler_pb2.RequestError(
        request_id="a", code=grpc.StatusCode.INVALID_ARGUMENT.value[0], message="bad"
    )
    _dispatch(message(output("a", 0, [5]), output("b", 0, [7]), errors=[error]), requests)
    assert sinks["a"].calls == [
        ("add", 0, [5]),
        ("flush",),
        ("fail", grpc.StatusCode.INVALID_ARGUMENT),
    ]
    assert set(requests) == {"b"}


def test_outputs_of_requests_no_longer_open_are_dropped():
    requests, sinks = open_requests(b=1)
    _dispatch(message(output("gone", 0, [1]), output("b", 0, [2])), requests)
    assert sinks["b"].calls == [("add", 0, [2]), ("flush",)]


def feed(num_samples: int = 1, process=lambda out: list(out.token_ids)) -> RequestFeed:
    attempts = Attempts(ResumeConfig(), lambda: 0.0, started=False)
    return RequestFeed(Progress.fresh(num_samples), attempts, process)


def test_feed_hands_over_one_batch_per_step_and_records_progress():
    f = feed(2)
    f.add(sample(0, [1, 2]))
    f.add(sample(1, [3]))
    f.flush()
    f.add(sample(0, [], FinishReason.STOP))
    f.add(sample(1, [4], FinishReason.LENGTH))
    f.flush()

    async def drain():
        return [await f.next_batch() for _ in range(3)]

    assert asyncio.run(drain()) == [[[1, 2], [3]], [[], [4]], None]
    assert [s.token_ids for s in f.progress.samples] == [[1, 2], [3, 4]]
    assert f.progress.all_finished


def test_feed_ends_when_process_finishes_the_last_sample_itself():
    """A stop string: the router ends the sample (progress.finish), the scheduler has not."""
    f = feed(1)

    def process(out):
        f.progress.finish(out.index)
        return "last"

    f.process = process
    f.add(sample(0, [1]))
    f.flush()

    async def drain():
        return [await f.next_batch(), await f.next_batch()]

    assert asyncio.run(drain()) == [["last"], None]


def test_a_bug_in_processing_fails_its_request_once_and_drops_the_rest():
    def process(out):
        if out.token_ids[0] == 2:
            raise ZeroDivisionError("a bug")
        return out.token_ids[0]

    f = feed(1, process)
    f.add(sample(0, [1]))
    f.add(sample(0, [2]))
    f.add(sample(0, [3]))  # dropped: the request failed
    f.flush()
    f.add(sample(0, [4], FinishReason.LENGTH))
    f.flush()

    async def drain():
        first = await f.next_batch()
        with pytest.raises(ZeroDivisionError):
            await f.next_batch()
        return first, f._queue.qsize()

    assert asyncio.run(drain()) == ([1], 0)  # raised once, no END after it


def test_a_failure_comes_after_what_was_already_received():
    f = feed(1)
    f.add(sample(0, [1]))
    f.fail(rpc_error(grpc.StatusCode.UNAVAILABLE, "scheduler gone"))

    async def drain():
        first = await f.next_batch()
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await f.next_batch()
        return first, error.value.code()

    assert asyncio.run(drain()) == ([[1]], grpc.StatusCode.UNAVAILABLE)


def test_a_request_whose_samples_end_handed_off_is_handed_over_after_its_flush():
    requests, sinks = open_requests(a=2)
    sinks["a"].hand_over = lambda: sinks["a"].calls.append(("hand_over",))  # type: ignore[attr-defined]
    handed = scheduler_pb2.SubmitResponse(request_id="a", index=0, token_ids=[5])
    handed.kv_handoff.CopyFrom(scheduler_pb2.KvHandoff(index=0, handoff_id="a#0", num_tokens=9))
    _dispatch(message(handed, output("a", 1, [6], finish_reason=STOP)), requests)
    assert sinks["a"].calls == [("add", 0, [5]), ("add", 1, [6]), ("flush",), ("hand_over",)]
    assert "a" not in requests


def test_a_feed_keeps_the_handoff_with_its_group_and_raises_handed_over():
    asyncio.run(_feed_hands_over())


async def _feed_hands_over() -> None:
    from router.request_feed import HandedOver
    from router.types import KVHandoff

    progress = Progress.fresh(1)
    feed = RequestFeed(progress, Attempts(ResumeConfig(), lambda: 0.0, False), lambda o: o)
    feed.source_address = "10.0.0.7:5000"
    feed.add(SampleOutput(0, [5], kv_handoff=KVHandoff(0, "r", 9)))
    feed.flush()
    feed.hand_over()
    assert [o.token_ids for o in await feed.next_batch()] == [[5]]
    with pytest.raises(HandedOver):
        await feed.next_batch()
    assert progress.samples[0].kv_handoff == KVHandoff(0, "r", 9, "10.0.0.7:5000")
    progress.record(0, [6], False)  # the sample moved on: its handoff is spent
    assert progress.samples[0].kv_handoff is None
