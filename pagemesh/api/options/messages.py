"""The request options as generate.proto's messages: `SamplingParams` and `StoppingCriteria`,
field for field. The SDK's `GenerateRequest` and the router's `SubmitRequest` to a scheduler
carry the same two messages, built here once."""

from __future__ import annotations

from pagemesh.api.options.validation import SamplingOptions, StoppingOptions
from protos.pagemesh.v1 import generate_pb2


def sampling_message(s: SamplingOptions) -> generate_pb2.SamplingParams:
    return generate_pb2.SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        repetition_penalty=s.repetition_penalty,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        seed=s.seed,
    )


def stopping_message(stopping: StoppingOptions) -> generate_pb2.StoppingCriteria:
    """`max_tokens` None (up to the end of the context) is sent as unset."""
    return generate_pb2.StoppingCriteria(
        max_tokens=stopping.max_tokens,
        min_tokens=stopping.min_tokens,
        stop=stopping.stop,
        stop_token_ids=stopping.stop_token_ids,
        ignore_eos=stopping.ignore_eos,
    )
