"""The client's resume decisions (pagemesh/api/sdk/resume.py) on made-up streams: what a resume
asks for, what of a replay reaches the caller, and when to give up."""

from __future__ import annotations

import grpc
import pytest

from pagemesh.api.sdk import errors
from pagemesh.api.sdk.resume import ResumePolicy, StreamState
from pagemesh.api.sdk.types import Completion
from protos.pagemesh.v1 import generate_pb2

# Two samples' whole outputs; a token's text is its own (several characters, one a
# two-byte character), as the router's detokenizer would give it.
OUTPUTS = {0: [11, 12, 13, 14, 15, 16], 1: [21, 22, 23, 24, 25, 26]}


def text_of(token_id: int) -> str:
    return f"é{token_id}·"


def chunk(
    index: int, token_ids: list[int], *, final: bool = False, usage: bool = False
) -> generate_pb2.GenerateResponse:
    pb = generate_pb2.GenerateResponse(
        request_id="r", index=index, token_ids=token_ids, text="".join(map(text_of, token_ids))
    )
    pb.logprobs.extend(generate_pb2.TokenLogprob(token_id=t, logprob=-t / 100) for t in token_ids)
    if final:
        pb.finish_reason = generate_pb2.FINISH_REASON_LENGTH
    if usage:
        pb.usage.prompt_tokens, pb.usage.completion_tokens = 4, 12
    return pb


def router(resume_from: int, live_from: dict[int, int]) -> list[generate_pb2.GenerateResponse]:
    """What a router sends for `resume_from`: each sample's checkpointed tokens after it
    (up to `live_from`) in one replay chunk, then one chunk per token to the end; each
    sample's last chunk has its finish reason, the last of all the usage."""
    out = []
    for index, start in live_from.items():
        if start > resume_from:
            out.append(chunk(index, OUTPUTS[index][resume_from:start], final=start == 6))
    for position in range(min(live_from.values()), 6):
        for index in OUTPUTS:
            if position >= live_from[index]:
                out.append(chunk(index, [OUTPUTS[index][position]], final=position == 5))
    out[-1].usage.prompt_tokens, out[-1].usage.completion_tokens = 4, 12
    return out


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def state(n: int = 2, num_addresses: int = 2, **policy: object) -> tuple[StreamState, Clock]:
    clock = Clock()
    request = generate_pb2.GenerateRequest(request_id="r", text="hi", n=n)
    return StreamState(
        request, ResumePolicy(**policy), num_addresses=num_addresses, clock=clock
    ), clock


def feed(
    s: StreamState, completion: Completion, responses: list[generate_pb2.GenerateResponse]
) -> None:
    for pb in responses:
        got = s.accept(pb)
        if got is not None:
            completion.add(got)


def assert_whole(completion: Completion) -> None:
    for index, token_ids in OUTPUTS.items():
        output = completion.outputs[index]
        assert output.token_ids == token_ids
        assert output.text == "".join(map(text_of, token_ids))
        assert [lp.token_id for lp in output.logprobs] == token_ids
        assert output.finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 12


def test_an_undisturbed_stream_passes_through() -> None:
    s, _ = state()
    completion = Completion.empty("r", 2)
    assert s.next_request().text == "hi"
    feed(s, completion, router(0, {0: 0, 1: 0}))
    assert s.complete
    assert_whole(completion)


def test_samples_broken_at_different_counts_resume_from_the_smaller_and_drop_the_rest() -> None:
    s, _ = state()
    completion = Completion.empty("r", 2)
    stream = router(0, {0: 0, 1: 0})
    feed(s, completion, stream[:7])  # sample 0 has 4 tokens, sample 1 has 3
    assert s.failed(grpc.StatusCode.UNAVAILABLE, "router died") == 0.0
    assert s.address_index == 1 and s.num_resumes == 1
    resume = s.next_request()
    assert (resume.request_id, resume.resume_from, resume.text) == ("r", 3, "")
    feed(s, completion, router(3, {0: 6, 1: 6}))  # the checkpoint had everything
    assert s.complete
    assert_whole(completion)


def test_a_multi_token_chunk_moves_the_resume_point_back_to_a_boundary() -> None:
    s, _ = state()
    completion = Completion.empty("r", 2)
    feed(
        s, completion, [chunk(0, [11]), chunk(1, [21]), chunk(0, [12, 13, 14]), chunk(1, [22, 23])]
    )
    s.failed(grpc.StatusCode.UNKNOWN, "stream reset")
    # Sample 0 passed 1 and 4 at a chunk's end, sample 1 passed 1 and 3: 1 is common.
    assert s.next_request().resume_from == 1
    feed(s, completion, router(1, {0: 2, 1: 2}))
    assert_whole(completion)


def test_nothing_common_but_zero_replays_everything_under_the_same_id() -> None:
    s, _ = state()
    completion = Completion.empty("r", 2)
    feed(s, completion, [chunk(0, [11, 12])])
    s.failed(grpc.StatusCode.UNAVAILABLE, "")
    again = s.next_request()
    assert (again.request_id, again.resume_from, again.text, again.n) == ("r", 0, "hi", 2)
    feed(s, completion, router(0, {0: 2, 1: 0}))
    assert_whole(completion)


def test_a_finished_samples_replayed_end_is_dropped_but_the_usage_kept() -> None:
    s, _ = state()
    completion = Completion.empty("r", 2)
    feed(s, completion, [chunk(0, OUTPUTS[0], final=True), chunk(1, OUTPUTS[1][:5])])
    s.failed(grpc.StatusCode.UNAVAILABLE, "")
    # Sample 0 came in one chunk: only 0 is a boundary of both.
    assert s.next_request().resume_from == 0
    replay = router(0, {0: 6, 1: 5})
    feed(s, completion, replay)
    assert_whole(completion)


def test_a_replayed_final_message_with_nothing_new_gives_only_the_usage() -> None:
    s, _ = state(n=1)
    completion = Completion.empty("r", 1)
    feed(s, completion, [chunk(0, [11]), chunk(0, [12], final=True)])
    s.failed(grpc.StatusCode.UNAVAILABLE, "")  # before the usage, say
    assert s.next_request().resume_from == 2
    again = chunk(0, [], final=True, usage=True)
    got = s.accept(again)
    assert got is not None and (got.token_ids, got.text, got.finish_reason) == ([], "", None)
    assert got.usage is not None and got.usage.total_tokens == 16


def test_a_request_that_received_nothing_tries_each_address_once() -> None:
    s, _ = state(n=1, num_addresses=2)
    assert s.failed(grpc.StatusCode.UNAVAILABLE, "refused") == 0.0
    with pytest.raises(errors.Unavailable, match=r"refused \(tried 2 router"):
        s.failed(grpc.StatusCode.UNAVAILABLE, "refused")


@pytest.mark.parametrize(
    "code, error",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, errors.InvalidArgument),
        (grpc.StatusCode.NOT_FOUND, errors.NotFound),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, errors.ResourceExhausted),
        (grpc.StatusCode.UNAUTHENTICATED, errors.Unauthenticated),
        (grpc.StatusCode.PERMISSION_DENIED, errors.PermissionDenied),
        (grpc.StatusCode.DATA_LOSS, errors.InternalError),
    ],
)
def test_a_failure_no_resume_can_fix_raises_its_typed_error(
    code: grpc.StatusCode, error: type
) -> None:
    s, _ = state()
    with pytest.raises(error) as caught:
        s.failed(code, "why")
    assert caught.value.code == code and caught.value.details == "why"
    assert caught.value.request_id == "r"


def started(**policy: object) -> tuple[StreamState, Clock]:
    s, clock = state(n=1, num_addresses=1, **policy)
    s.accept(chunk(0, [11]))
    return s, clock


def test_backoff_doubles_to_its_bound_and_a_new_chunk_resets_it() -> None:
    s, _ = started(initial_backoff_s=0.1, max_backoff_s=0.5)
    waits = [s.failed(grpc.StatusCode.UNAVAILABLE, "down") for _ in range(5)]
    assert waits == [0.1, 0.2, 0.4, 0.5, 0.5]
    s.accept(chunk(0, [12]))
    assert s.failed(grpc.StatusCode.UNAVAILABLE, "down") == 0.1


def test_resuming_gives_up_after_the_resume_timeout_without_a_chunk() -> None:
    s, clock = started(resume_timeout_s=10)
    s.failed(grpc.StatusCode.UNAVAILABLE, "down")
    clock.now = 9.95
    assert s.failed(grpc.StatusCode.UNAVAILABLE, "down") == pytest.approx(0.05)
    clock.now = 10.0
    with pytest.raises(errors.Unavailable, match="resume_timeout_s=10") as caught:
        s.failed(grpc.StatusCode.UNAVAILABLE, "down")
    assert caught.value.num_resumes == 2


def test_max_resumes_bounds_them_and_zero_turns_them_off() -> None:
    s, _ = started(max_resumes=0)
    with pytest.raises(errors.Unavailable, match="max_resumes=0"):
        s.failed(grpc.StatusCode.UNAVAILABLE, "down")


def test_suspect_failures_are_resumed_a_few_times_in_a_row() -> None:
    s, _ = started(max_suspect_retries=2)
    s.failed(None, "")
    s.failed(grpc.StatusCode.INTERNAL, "reset")
    with pytest.raises(errors.InternalError, match="3 times in a row"):
        s.failed(grpc.StatusCode.UNKNOWN, "reset")


def test_the_calls_own_deadline_is_not_resumed() -> None:
    clock = Clock()
    request = generate_pb2.GenerateRequest(request_id="r", text="hi")
    s = StreamState(request, ResumePolicy(), num_addresses=1, deadline=5.0, clock=clock)
    s.accept(chunk(0, [11]))
    assert s.failed(grpc.StatusCode.DEADLINE_EXCEEDED, "a proxy's") == 0.1
    clock.now = 5.0
    assert s.remaining_s() == 0.0
    with pytest.raises(errors.DeadlineExceeded):
        s.failed(grpc.StatusCode.DEADLINE_EXCEEDED, "ours")


def test_a_stream_begun_elsewhere_continues_after_its_count_and_resumes_again() -> None:
    clock = Clock()
    s = StreamState.resuming("r", 3, 2, ResumePolicy(), num_addresses=1, clock=clock)
    first = s.next_request()
    assert (first.request_id, first.resume_from, first.text) == ("r", 3, "")
    completion = Completion.empty("r", 2)
    stream = router(3, {0: 3, 1: 3})
    feed(s, completion, stream[:3])  # sample 0 has 5 tokens, sample 1 has 4
    s.failed(grpc.StatusCode.UNAVAILABLE, "")
    assert s.next_request().resume_from == 4
    feed(s, completion, router(4, {0: 5, 1: 4}))
    assert [o.token_ids for o in completion.outputs] == [OUTPUTS[0][3:], OUTPUTS[1][3:]]
    assert completion.outputs[1].text == "".join(map(text_of, OUTPUTS[1][3:]))


def test_a_resume_refused_by_the_admission_limit_waits_a_new_request_does_not() -> None:
    s, _ = started()
    assert s.failed(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full") == 0.1
    fresh, _ = state(n=1)
    with pytest.raises(errors.ResourceExhausted):
        fresh.failed(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")


def test_the_client_resumes_what_the_router_resumes() -> None:
    """The router resuming on engine groups and the client resuming on routers classify
    failures alike (router/resume.py; pagemesh/ does not import services)."""
    from pagemesh.api.sdk import resume as client_resume
    from router import resume as router_resume

    assert client_resume.PEER_GONE_CODES == router_resume.PEER_GONE_CODES
    assert client_resume.SUSPECT_CODES == router_resume.SUSPECT_CODES
