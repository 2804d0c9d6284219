"""The gRPC edge of the router's data plane: `GenerateRequest` -> `GenerationRequest` and
`TokenChunk` -> `GenerateResponse`, field by field (router/convert.py)."""

from __future__ import annotations

from protos.pagemesh.scheduler.v1 import scheduler_pb2
from protos.pagemesh.v1 import generate_pb2
from router import convert
from router.types import FinishReason, TokenChunk, TokenLogprob, TopLogprob, Usage


def test_unset_fields_stay_unset_for_validation() -> None:
    request = convert.generation_request(generate_pb2.GenerateRequest())
    assert request.prompt is None and request.request_id == "" and not request.new_request
    assert request.sampling.temperature is None and request.sampling.seed is None
    assert request.stopping.max_tokens is None and request.num_logprobs is None and request.n == 1


def test_prompt_and_options_carry_over() -> None:
    text = convert.generation_request(generate_pb2.GenerateRequest(
        request_id="r", text="", apply_chat_template=True, model="m", resume_from=3))
    assert text.prompt == "" and text.apply_chat_template and text.model == "m" and text.resume_from == 3
    ids = convert.generation_request(generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=[1, 2]), logprobs=2, n=3, priority=-1,
        sampling=generate_pb2.SamplingParams(temperature=0, seed=7),
        stopping=generate_pb2.StoppingCriteria(max_tokens=5, stop=["x"])))
    assert ids.prompt == [1, 2] and ids.num_logprobs == 2 and ids.n == 3 and ids.priority == -1
    assert ids.sampling.temperature == 0 and ids.sampling.seed == 7
    assert ids.stopping.max_tokens == 5 and ids.stopping.stop == ["x"]


def test_token_chunks_become_generate_responses() -> None:
    running = convert.generate_response(TokenChunk("r", 1, [4], "a", []))
    assert running.finish_reason == generate_pb2.FINISH_REASON_UNSPECIFIED
    assert not running.HasField("usage") and list(running.token_ids) == [4] and running.index == 1
    last = convert.generate_response(TokenChunk(
        "r", 0, [5], "b", [TokenLogprob(5, -0.5, [TopLogprob(5, -0.5, "b")])],
        FinishReason.LENGTH, Usage(3, 4)))
    assert last.finish_reason == generate_pb2.FINISH_REASON_LENGTH
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (3, 4)
    assert last.logprobs[0].top[0].token == "b" and last.logprobs[0].logprob == -0.5


def test_every_finish_reason_round_trips() -> None:
    for value in generate_pb2.FinishReason.values():
        assert convert.finish_reason_to_pb(convert.finish_reason_from_pb(value)) == value


def test_scheduler_messages_become_sample_outputs() -> None:
    message = scheduler_pb2.SubmitResponse(index=2, token_ids=[7, 8], finish_reason=generate_pb2.FINISH_REASON_STOP)
    output = convert.sample_output(message)
    assert (output.index, output.token_ids, output.finish_reason, output.logprobs) == (2, [7, 8], "stop", [])
