"""The gRPC edges of the router's data plane, field by field (router/convert.py):
`GenerateRequest` -> `GenerationRequest`, `TokenChunk` -> `GenerateResponse`, and a
`Submission` -> the scheduler's `SubmitRequest` (with an attempt's progress) -> a checkpoint."""

from __future__ import annotations

from pagemesh.api.options.validation import SamplingOptions, StoppingOptions, ValidatedRequest
from protos.pagemesh.scheduler.v1 import scheduler_pb2
from protos.pagemesh.v1 import generate_pb2
from router import convert
from router.resume import Progress, SampleProgress
from router.types import FinishReason, Submission, TokenChunk, TokenLogprob, TopLogprob, Usage


def test_unset_fields_stay_unset_for_validation() -> None:
    request = convert.generation_request(generate_pb2.GenerateRequest())
    assert request.prompt is None and request.request_id == "" and not request.new_request
    assert request.sampling.temperature is None and request.sampling.seed is None
    assert request.stopping.max_tokens is None and request.num_logprobs is None and request.n == 1


def test_prompt_and_options_carry_over() -> None:
    text = convert.generation_request(
        generate_pb2.GenerateRequest(
            request_id="r", text="", apply_chat_template=True, model="m", resume_from=3
        )
    )
    assert (
        text.prompt == ""
        and text.apply_chat_template
        and text.model == "m"
        and text.resume_from == 3
    )
    ids = convert.generation_request(
        generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=[1, 2]),
            logprobs=2,
            n=3,
            priority=-1,
            sampling=generate_pb2.SamplingParams(temperature=0, seed=7),
            stopping=generate_pb2.StoppingCriteria(max_tokens=5, stop=["x"]),
        )
    )
    assert ids.prompt == [1, 2] and ids.num_logprobs == 2 and ids.n == 3 and ids.priority == -1
    assert ids.sampling.temperature == 0 and ids.sampling.seed == 7
    assert ids.stopping.max_tokens == 5 and ids.stopping.stop == ["x"]


def test_token_chunks_become_generate_responses() -> None:
    running = convert.generate_response(TokenChunk("r", 1, [4], "a", []))
    assert running.finish_reason == generate_pb2.FINISH_REASON_UNSPECIFIED
    assert not running.HasField("usage") and list(running.token_ids) == [4] and running.index == 1
    last = convert.generate_response(
        TokenChunk(
            "r",
            0,
            [5],
            "b",
            [TokenLogprob(5, -0.5, [TopLogprob(5, -0.5, "b")])],
            FinishReason.LENGTH,
            Usage(3, 4),
        )
    )
    assert last.finish_reason == generate_pb2.FINISH_REASON_LENGTH
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (3, 4)
    assert last.logprobs[0].top[0].token == "b" and last.logprobs[0].logprob == -0.5


def test_every_finish_reason_round_trips() -> None:
    for value in generate_pb2.FinishReason.values():
        assert convert.finish_reason_to_pb(convert.finish_reason_from_pb(value)) == value


def test_scheduler_messages_become_sample_outputs() -> None:
    message = scheduler_pb2.SubmitResponse(
        index=2, token_ids=[7, 8], finish_reason=generate_pb2.FINISH_REASON_STOP
    )
    output = convert.sample_output(message)
    assert (output.index, output.token_ids, output.finish_reason, output.logprobs) == (
        2,
        [7, 8],
        "stop",
        [],
    )


def submission(seed: int | None = None) -> Submission:
    validated = ValidatedRequest(
        [3, 4, 5],
        SamplingOptions(temperature=0.5, top_p=1.0, top_k=4, repetition_penalty=1.0, seed=seed),
        StoppingOptions(max_tokens=6, stop=["x"], stop_token_ids=[9]),
        num_logprobs=2,
        n=2,
        priority=-1,
    )
    return Submission.fresh("r", validated, 42)


def test_a_submission_draws_its_seed_only_when_unset() -> None:
    assert submission().sampling.seed == 42 and submission(seed=7).sampling.seed == 7
    assert submission().max_tokens == 6 and submission().num_logprobs == 2


def test_a_submission_becomes_a_submit_request_with_each_attempts_progress() -> None:
    fresh = convert.submit_request(submission())
    assert (
        fresh.request_id,
        list(fresh.prompt_token_ids),
        fresh.n,
        fresh.priority,
        fresh.logprobs,
    ) == ("r", [3, 4, 5], 2, -1, 2)
    assert (
        fresh.sampling.seed == 42
        and fresh.sampling.top_k == 4
        and fresh.sampling.temperature == 0.5
    )
    assert fresh.stopping.max_tokens == 6 and list(fresh.stopping.stop) == ["x"]
    assert not fresh.progress and not fresh.trace_context
    resumed = convert.submit_request(
        submission(), Progress([SampleProgress([1, 2], True), SampleProgress([6])])
    )
    assert [(p.index, list(p.token_ids), p.finished) for p in resumed.progress] == [
        (0, [1, 2], True),
        (1, [6], False),
    ]


def test_a_checkpointed_submit_request_reads_back_as_the_same_submission() -> None:
    sent = submission()
    stored = convert.submit_request(sent, Progress([SampleProgress([1]), SampleProgress()]))
    assert convert.submission_from_checkpoint(stored.SerializeToString()) == sent
