"""`pagemesh.SamplingParams`: vLLM's names and defaults, rejected with the servers' words,
and the `GenerateRequest` the SDK sends means to the router what the params say."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagemesh.api.options.constraint import OutputConstraint
from pagemesh.api.options.validation import (
    ModelLimits,
    SamplingOptions,
    StoppingOptions,
    ValidationError,
    validate,
)
from pagemesh.api.sampling_params import (
    SamplingParams,
    StructuredOutputsParams,
    to_generate_request,
)
from router import convert
from router.openai_errors import ProtocolError
from router.openai_protocol import parse_completion

LIMITS = ModelLimits("m", max_model_len=64, vocab_size=100, eos_token_ids=[0])


def test_defaults_are_vllms() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens, p.logprobs) == (
        1,
        1.0,
        1.0,
        0,
        0.0,
        16,
        None,
    )
    assert p.options().stopping.max_tokens == 16
    assert SamplingParams(max_tokens=None).options().stopping.max_tokens is None
    assert SamplingParams(top_k=-1).options().sampling.top_k == 0  # vLLM's "off"


def _grpc_message(**fields: object) -> str:
    """What the gRPC API answers a request with these (range-checked) fields."""
    sampling_names = {f for f in SamplingOptions.__dataclass_fields__}
    sampling = SamplingOptions(**{k: v for k, v in fields.items() if k in sampling_names})
    stopping = StoppingOptions(
        **{k: v for k, v in fields.items() if k in ("max_tokens", "min_tokens", "stop")}
    )
    with pytest.raises(ValidationError) as caught:
        validate(
            [1, 2], sampling, stopping, fields.get("logprobs"), "", LIMITS, n=fields.get("n", 1)
        )
    return str(caught.value)


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": -0.5},
        {"top_p": 0.0},
        {"top_k": -3},
        {"min_p": 1.5},
        {"repetition_penalty": 0.0},
        {"presence_penalty": 2.5},
        {"frequency_penalty": -3.0},
        {"seed": -1},
        {"max_tokens": 0},
        {"n": 17},
        {"logprobs": 21},
        {"stop": [""]},
        {"min_tokens": -1},
    ],
)
def test_out_of_range_is_the_grpc_servers_message(fields: dict) -> None:
    with pytest.raises(ValueError) as caught:
        SamplingParams(**fields)
    assert str(caught.value) == _grpc_message(**fields)


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": "hot"},
        {"top_k": 1.5},
        {"n": "2"},
        {"stop": 3},
        {"seed": 1.0},
        {"stop_token_ids": ["a"]},
        {"ignore_eos": "yes"},
        {"max_tokens": float("inf")},
        {"structured_outputs": {"json": 3}},
    ],
)
def test_wrong_type_is_the_http_servers_message(fields: dict) -> None:
    with pytest.raises(ValueError) as caught:
        SamplingParams(**fields)
    with pytest.raises(ProtocolError) as http:
        parse_completion({"prompt": "x", **fields})
    assert str(caught.value) == str(http.value)


def test_text_options_are_checked() -> None:
    with pytest.raises(ValueError, match="detokenize must be true or false"):
        SamplingParams(detokenize=1)
    with pytest.raises(ValueError, match="stop strings need detokenize=True"):
        SamplingParams(detokenize=False, stop="x")


def test_generate_request_means_what_the_params_say() -> None:
    # Values a float32 holds exactly: the wire carries float32.
    params = SamplingParams(
        n=2,
        temperature=0.75,
        top_p=0.875,
        top_k=-1,
        min_p=0.0625,
        seed=11,
        max_tokens=None,
        min_tokens=2,
        stop="END",
        stop_token_ids=[5],
        ignore_eos=False,
        logprobs=0,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.125,
        structured_outputs=StructuredOutputsParams(choice=["a", "b"]),
    )
    parsed = convert.generation_request(to_generate_request("hello", params, chat=True))
    assert parsed.prompt == "hello" and parsed.apply_chat_template and parsed.n == 2
    assert parsed.sampling == params.options().sampling
    assert parsed.stopping == params.options().stopping
    assert parsed.num_logprobs == 1  # vLLM's logprobs=0 still returns the chosen token's
    assert parsed.constraint == OutputConstraint("choice", ("a", "b"))
    ids = convert.generation_request(to_generate_request([3, 4], SamplingParams()))
    assert ids.prompt == [3, 4] and ids.stopping.max_tokens == 16 and ids.num_logprobs is None
    with pytest.raises(ValueError, match="needs a `text` prompt"):
        to_generate_request([3, 4], SamplingParams(), chat=True)


def test_import_pagemesh_stays_light() -> None:
    code = (
        "import sys, pagemesh; assert pagemesh.SamplingParams; "
        "heavy = [m for m in ('torch', 'grpc', 'transformers') if m in sys.modules]; "
        "assert not heavy, heavy; "
        "assert {'LLM', 'SamplingParams', 'RequestOutput', 'CompletionOutput', 'Client', "
        "'AsyncClient', 'PagemeshError', 'InvalidArgument'} <= set(pagemesh.__all__)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_params_are_checked_once_per_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """Made once, checked once: the request built from the params (the SDK's GenerateRequest,
    the offline engine's `validate(options_checked=True)`) does not check them again; a field
    changed afterwards, in place too, is checked on next use."""
    from pagemesh.api import sampling_params as module

    calls = []
    real = module.check_options
    monkeypatch.setattr(module, "check_options", lambda *a, **k: calls.append(1) or real(*a, **k))
    params = SamplingParams(max_tokens=8, stop=["x"])
    to_generate_request("Hi", params)
    options = params.options()
    validated = validate(
        [1, 2],
        options.sampling,
        options.stopping,
        options.num_logprobs,
        "",
        LIMITS,
        n=options.n,
        options_checked=True,
    )
    assert len(calls) == 1 and validated.max_tokens == 8
    params.stop.append("")  # in place: the next use sees it
    with pytest.raises(ValueError, match="stop string 1 is empty"):
        params.options()
    params.stop.pop()
    params.max_tokens = 0
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        to_generate_request("Hi", params)
    # What needs the model is still checked with options_checked.
    params.max_tokens, params.stop_token_ids = 8, [100]
    with pytest.raises(ValidationError, match="stop token id"):
        validate([1], *_parts(params.options()), "", LIMITS, options_checked=True)


def _parts(options):
    return options.sampling, options.stopping, options.num_logprobs
