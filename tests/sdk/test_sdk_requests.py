"""How a client call's arguments become a GenerateRequest (pagemesh/api/sdk/common.py), and the
errors' mapping from gRPC status codes."""

from __future__ import annotations

import grpc
import pytest

from pagemesh.api.sampling_params import SamplingParams
from pagemesh.api.sdk import errors
from pagemesh.api.sdk.common import ClientConfig, build_request, chat_text


def test_overrides_replace_the_sampling_params_fields_and_ids_are_made_up() -> None:
    base = SamplingParams(temperature=0.5, max_tokens=8, seed=3)
    request = build_request("hi", base, {"max_tokens": 4, "stop": ["\n"]}, priority=2)
    assert request.text == "hi" and request.priority == 2
    assert request.sampling.temperature == 0.5 and request.sampling.seed == 3
    assert request.stopping.max_tokens == 4 and list(request.stopping.stop) == ["\n"]
    assert request.request_id.startswith("pm-")
    assert build_request("hi", None, {}).request_id != request.request_id
    assert build_request([1, 2], None, {}, request_id="job-1").token_ids.ids == [1, 2]
    assert base.max_tokens == 8  # the caller's params are not changed


def test_bad_parameters_are_invalid_argument_and_value_error() -> None:
    with pytest.raises(errors.InvalidArgument, match="temperature") as caught:
        build_request("hi", None, {"temperature": -1.0})
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert isinstance(caught.value, ValueError)
    with pytest.raises(TypeError):
        build_request("hi", None, {"temprature": 0.0})


def test_chat_takes_one_user_message_and_refuses_what_grpc_cannot_carry() -> None:
    assert chat_text("hi") == "hi"
    assert chat_text([{"role": "user", "content": "hi"}]) == "hi"
    for messages in (
        [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}],
        [{"role": "assistant", "content": "a"}],
        [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    ):
        with pytest.raises(errors.InvalidArgument, match="/v1/chat/completions"):
            chat_text(messages)


def test_the_config_checks_its_arguments() -> None:
    def build(address: object = "h:1", **kwargs: object) -> ClientConfig:
        args = {
            "api_key": None,
            "tls": None,
            "ca_path": None,
            "cert_path": None,
            "key_path": None,
            "timeout_s": None,
            "resume_timeout_s": 60.0,
            "max_resumes": None,
        }
        return ClientConfig.build(address, **{**args, **kwargs})

    assert build(["a:1", "b:2"]).addresses == ("a:1", "b:2")
    assert build(api_key="k").metadata() == (("authorization", "Bearer k"),)
    assert build().metadata() is None
    for bad in (
        {"address": []},
        {"timeout_s": 0},
        {"max_resumes": -1},
        {"cert_path": "/nonexistent.pem"},
    ):
        with pytest.raises(ValueError):
            build(**bad)


@pytest.mark.parametrize(
    "code, error",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, errors.InvalidArgument),
        (grpc.StatusCode.OUT_OF_RANGE, errors.InvalidArgument),
        (grpc.StatusCode.NOT_FOUND, errors.NotFound),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, errors.ResourceExhausted),
        (grpc.StatusCode.UNAVAILABLE, errors.Unavailable),
        (grpc.StatusCode.DEADLINE_EXCEEDED, errors.DeadlineExceeded),
        (grpc.StatusCode.UNAUTHENTICATED, errors.Unauthenticated),
        (grpc.StatusCode.PERMISSION_DENIED, errors.PermissionDenied),
        (grpc.StatusCode.CANCELLED, errors.Cancelled),
        (grpc.StatusCode.INTERNAL, errors.InternalError),
        (grpc.StatusCode.UNIMPLEMENTED, errors.InternalError),
    ],
)
def test_each_status_has_its_error(code: grpc.StatusCode, error: type) -> None:
    raised = errors.from_status(code, "why", request_id="r")
    assert type(raised) is error and isinstance(raised, errors.PagemeshError)
    assert (raised.code, raised.details, raised.request_id) == (code, "why", "r")
    assert str(raised) == f"{code.name}: why"
    assert errors.PermissionDenied("x").code == grpc.StatusCode.PERMISSION_DENIED
