"""The core's admission door on plain types (scheduler_svc/core/admission.py `core_request`):
the scheduler service's protobuf path and the offline LLM's plain path meet there, so a
request means the same whichever way it came."""

from __future__ import annotations

import pytest

from offline.batch import request_spec
from protos.pagemesh.scheduler.v1 import scheduler_pb2
from protos.pagemesh.v1 import generate_pb2
from protos.step import SamplingParams
from router.types import SamplingOptions, StoppingOptions, Submission
from scheduler_svc import convert
from scheduler_svc.core.admission import RequestSpec, core_request

EOS = [2, 7]


def test_the_rules_hold_on_plain_types() -> None:
    request = core_request(
        RequestSpec("r1", [5, 6], seed=9, max_tokens=4, stop_token_ids=[11]), EOS, 1.0
    )
    assert request.sampling.stop_token_ids == (2, 7, 11)  # EOS joins the stop ids
    defaults = SamplingParams()
    assert (request.sampling.temperature, request.sampling.top_p) == (
        defaults.temperature,
        defaults.top_p,
    )
    ignoring = core_request(
        RequestSpec("r2", [5], seed=1, max_tokens=4, ignore_eos=True, temperature=0.0), EOS, 1.0
    )
    assert ignoring.sampling.stop_token_ids == () and ignoring.sampling.temperature == 0.0
    with pytest.raises(ValueError, match="request_id is empty"):
        core_request(RequestSpec("", [5], seed=1, max_tokens=4), EOS, 1.0)
    with pytest.raises(ValueError, match="seed is unset"):
        core_request(RequestSpec("r3", [5], seed=None, max_tokens=4), EOS, 1.0)


def test_the_protobuf_and_the_plain_path_admit_the_same_request() -> None:
    submission = Submission(
        "r9",
        [3, 4, 5],
        SamplingOptions(
            temperature=0.7,
            top_p=0.9,
            top_k=5,
            min_p=0.05,
            repetition_penalty=1.1,
            presence_penalty=0.2,
            frequency_penalty=0.3,
            seed=42,
        ),
        StoppingOptions(max_tokens=12, min_tokens=2, stop=["x"], stop_token_ids=[9]),
        num_logprobs=3,
        n=1,
        priority=-4,
        grammar="",
    )
    from router import convert as router_convert

    via_pb = convert.submission_from_pb(router_convert.submit_request(submission), EOS, 5.0)
    plain = core_request(request_spec(submission), EOS, 5.0)
    assert via_pb.requests == [plain]


def test_fields_left_unset_in_protobuf_take_the_defaults() -> None:
    pb = scheduler_pb2.SubmitRequest(
        request_id="r",
        prompt_token_ids=[1],
        sampling=generate_pb2.SamplingParams(seed=3),
        stopping=generate_pb2.StoppingCriteria(max_tokens=2),
    )
    (request,) = convert.submission_from_pb(pb, EOS, 0.0).requests
    assert (
        request.sampling
        == core_request(RequestSpec("r", [1], seed=3, max_tokens=2), EOS, 0.0).sampling
    )
