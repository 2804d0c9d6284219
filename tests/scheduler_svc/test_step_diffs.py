"""A decode step's message does not grow with context length: new requests travel in
full once, afterwards only diffs (new block ids, number of computed tokens)."""

from __future__ import annotations

from protos.step import ModelRunnerOutput, RequestId, SampledToken, SamplingParams
from scheduler_svc import convert
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.core.types import Request


def decode_step_bytes(context_len: int) -> tuple[int, int]:
    """(bytes of the step that admits the request, bytes of a later decode step)."""
    scheduler = Scheduler(
        SchedulerConfig(
            num_blocks=512, block_size=16, max_model_len=8192, max_num_batched_tokens=8192
        )
    )
    scheduler.add_request(Request(RequestId("r"), list(range(context_len)), SamplingParams(), 100))
    first = scheduler.schedule()
    scheduler.update(first, ModelRunnerOutput(first.step_id, {RequestId("r"): SampledToken(5)}))
    sizes = []
    for _ in range(3):  # decode steps; pick one that adds no block, like most do
        out = scheduler.schedule()
        sizes.append(convert.scheduler_output_to_pb(out).ByteSize())
        scheduler.update(out, ModelRunnerOutput(out.step_id, {RequestId("r"): SampledToken(5)}))
    return convert.scheduler_output_to_pb(first).ByteSize(), min(sizes)


def test_decode_step_size_is_independent_of_context_length() -> None:
    short_admit, short_decode = decode_step_bytes(100)
    long_admit, long_decode = decode_step_bytes(4000)
    assert long_admit > 10 * short_decode  # the prompt travels once, in full ...
    assert long_decode - short_decode <= 2  # ... and never again (a varint may grow a byte)
    assert long_decode < 64
