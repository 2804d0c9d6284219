import math

import pytest

from pagemesh.api.options.validation import (
    ModelLimits,
    SamplingOptions,
    StoppingOptions,
    ValidationError,
    check_identity,
    resume_offsets,
    validate,
)

LIMITS = ModelLimits(name="smol", max_model_len=100, vocab_size=50, eos_token_ids=[2])


def run(
    prompt=(1, 2, 3),
    sampling=SamplingOptions(),
    stopping=StoppingOptions(),
    num_logprobs=None,
    model="",
):
    return validate(list(prompt), sampling, stopping, num_logprobs, model, LIMITS)


def test_defaults_are_filled():
    request = run()
    assert request.sampling.temperature == 1.0
    assert request.sampling.top_p == 1.0
    assert request.sampling.repetition_penalty == 1.0
    assert request.sampling.seed is None
    assert request.max_tokens == 97
    assert request.stopping.max_tokens == 97
    assert request.prompt_token_ids == [1, 2, 3]


def test_given_values_are_kept():
    sampling = SamplingOptions(
        temperature=0.0,
        top_p=0.5,
        top_k=5,
        min_p=0.1,
        repetition_penalty=1.2,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        seed=7,
    )
    stopping = StoppingOptions(max_tokens=97, min_tokens=97, stop=["x"], stop_token_ids=[49])
    request = run(sampling=sampling, stopping=stopping, num_logprobs=20, model="smol")
    assert request.sampling == sampling
    assert request.stopping == stopping
    assert request.num_logprobs == 20


def expect_error(match: str, **kwargs):
    with pytest.raises(ValidationError, match=match):
        run(**kwargs)


def test_empty_prompt():
    expect_error("prompt is empty", prompt=[])


def test_prompt_as_long_as_context():
    expect_error(
        r"prompt has 100 tokens but the model's context is 100; shorten the prompt",
        prompt=[1] * 100,
    )


def test_max_tokens_zero_and_negative():
    expect_error("max_tokens must be at least 1", stopping=StoppingOptions(max_tokens=0))
    expect_error("max_tokens must be at least 1", stopping=StoppingOptions(max_tokens=-3))


def test_prompt_plus_max_tokens_over_context_names_maximum():
    expect_error("at most 97", stopping=StoppingOptions(max_tokens=98))


def test_min_tokens_over_max_tokens():
    expect_error("min_tokens", stopping=StoppingOptions(max_tokens=5, min_tokens=6))
    expect_error("min_tokens", stopping=StoppingOptions(min_tokens=98))  # default max is 97
    expect_error("min_tokens", stopping=StoppingOptions(min_tokens=-1))


@pytest.mark.parametrize(
    ("sampling", "name"),
    [
        (SamplingOptions(temperature=-0.1), "temperature"),
        (SamplingOptions(temperature=math.nan), "temperature"),
        (SamplingOptions(temperature=math.inf), "temperature"),
        (SamplingOptions(top_p=0.0), "top_p"),
        (SamplingOptions(top_p=1.01), "top_p"),
        (SamplingOptions(top_p=math.nan), "top_p"),
        (SamplingOptions(top_k=-1), "top_k"),
        (SamplingOptions(min_p=-0.01), "min_p"),
        (SamplingOptions(min_p=1.5), "min_p"),
        (SamplingOptions(repetition_penalty=0.0), "repetition_penalty"),
        (SamplingOptions(repetition_penalty=-1.0), "repetition_penalty"),
        (SamplingOptions(presence_penalty=2.1), "presence_penalty"),
        (SamplingOptions(frequency_penalty=-2.1), "frequency_penalty"),
        (SamplingOptions(seed=-1), "seed"),
    ],
)
def test_sampling_out_of_range(sampling, name):
    expect_error(name, sampling=sampling)


def test_num_logprobs_limits():
    expect_error("logprobs must be in", num_logprobs=21)
    expect_error("logprobs must be in", num_logprobs=-1)
    assert run(num_logprobs=0).num_logprobs == 0


def test_wrong_model_lists_served_name():
    expect_error("'smol'", model="llama")
    assert run(model="smol").max_tokens == 97


def test_prompt_token_out_of_vocab_names_id_and_position():
    expect_error("prompt token id 50 at position 2", prompt=[1, 2, 50])
    expect_error("prompt token id -1 at position 0", prompt=[-1])


def test_stop_token_id_out_of_vocab():
    expect_error("stop token id 77 at position 1", stopping=StoppingOptions(stop_token_ids=[3, 77]))


def test_stop_strings_count_and_empty():
    expect_error("at most 16 stop strings", stopping=StoppingOptions(stop=["a"] * 17))
    expect_error("stop string 1 is empty", stopping=StoppingOptions(stop=["a", ""]))
    assert len(run(stopping=StoppingOptions(stop=["a"] * 16)).stopping.stop) == 16


def test_stop_strings_length_and_unicode():
    expect_error(
        "stop string 1 is 513 characters; at most 512",
        stopping=StoppingOptions(stop=["a", "x" * 513]),
    )
    expect_error("stop string 0 is not valid Unicode", stopping=StoppingOptions(stop=["ok\ud800"]))
    assert run(stopping=StoppingOptions(stop=["x" * 512, "é"])).stopping.stop[1] == "é"


def test_priority_range():
    for priority in (1_000_001, -1_000_001, 2**63):
        with pytest.raises(ValidationError, match="priority must be in"):
            validate(
                [1, 2], SamplingOptions(), StoppingOptions(), None, "", LIMITS, priority=priority
            )
    assert (
        validate(
            [1], SamplingOptions(), StoppingOptions(), None, "", LIMITS, priority=-1_000_000
        ).priority
        == -1_000_000
    )


def test_validation_error_is_value_error():
    assert issubclass(ValidationError, ValueError)


def test_model_limits_reject_nonsense():
    with pytest.raises(ValueError):
        ModelLimits(name="m", max_model_len=0, vocab_size=10)


def test_n_and_priority():
    request = validate(
        [1, 2], SamplingOptions(), StoppingOptions(), None, "", LIMITS, n=4, priority=-3
    )
    assert request.n == 4 and request.priority == -3
    assert run().n == 1
    for bad_n in (0, 17):
        with pytest.raises(ValidationError, match="n must be in 1..16"):
            validate([1, 2], SamplingOptions(), StoppingOptions(), None, "", LIMITS, n=bad_n)


def test_identity_checks_come_before_anything_is_counted():
    check_identity("", 0, 1)
    check_identity("job-42", [0, 3], 16)
    for args, message in [
        (("a" * 257, 0, 1), "at most 256"),
        (("x\n", 0, 1), "printable ASCII"),
        (("", -1, 1), r"resume_from must be >= 0 \(output tokens already received\), got -1"),
        (("", [2, -1], 2), r"\(sample 1\), got -1"),
        (("", 0, 0), r"n must be in 1..16"),
        (("", 0, 2**31), r"n must be in 1..16"),
    ]:
        with pytest.raises(ValidationError, match=message):
            check_identity(*args)


def test_resume_offsets_are_one_count_per_sample():
    assert resume_offsets(3, 2) == [3, 3]
    assert resume_offsets([3, 1], 2) == [3, 1]
    with pytest.raises(
        ValidationError, match="resume_from has 1 counts but the request has 2 samples"
    ):
        resume_offsets([3], 2)
