"""The checkpoint record's JSON: logprobs kept exactly when a request asks for them, no
logprob data at all when it does not, and older records (without the field) still read."""

from __future__ import annotations

import json
import struct

from pagemesh.runtime.checkpoints import RUNNING, Checkpoint, SampleState


def float32(value: float) -> float:
    """What a value becomes on the wire (protobuf `float`)."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


def logprobs(num_tokens: int, num_top: int) -> list[tuple[float, list[tuple[int, float]]]]:
    return [
        (
            float32(-0.1 - 0.37 * t),
            [(1000 * t + i, float32(-0.2 - 0.53 * i - t / 7)) for i in range(num_top)],
        )
        for t in range(num_tokens)
    ]


def test_logprobs_round_trip_exactly_per_sample() -> None:
    first = logprobs(6, 5)
    first[2] = (float("-inf"), [(7, float("-inf"))])  # a ragged top list and -inf survive too
    samples = [
        SampleState([5, 6, 7, 8, 9, 10], False, 0, first),
        SampleState([3], True, 2, logprobs(1, 20)),
        SampleState([], False, 0, []),
    ]
    ckpt = Checkpoint("r1", "g0", b"\x01\x02", samples, RUNNING, 12.5)
    back = Checkpoint.from_json(ckpt.to_json())
    assert [s.logprobs for s in back.samples] == [s.logprobs for s in samples]
    assert back.samples == samples and back.submit == ckpt.submit


def test_a_double_is_kept_as_the_float32_the_wire_carries() -> None:
    sample = SampleState([4], logprobs=[(-0.1, [(4, -0.1), (9, -2.3)])])
    back = Checkpoint.from_json(Checkpoint("r", "g", b"", [sample]).to_json()).samples[0]
    assert back.logprobs == [(float32(-0.1), [(4, float32(-0.1)), (9, float32(-2.3))])]


def test_without_logprobs_the_record_holds_no_logprob_data() -> None:
    raw = Checkpoint("r1", "g0", b"", [SampleState([1, 2, 3]), SampleState([4], True, 1)]).to_json()
    assert "logprobs" not in raw
    assert all(s.logprobs is None for s in Checkpoint.from_json(raw).samples)


def test_an_older_record_reads_as_having_no_logprobs() -> None:
    older = json.dumps(
        {
            "request_id": "old",
            "group": "g0",
            "submit": "",
            "state": RUNNING,
            "updated_at": 1.0,
            "samples": [{"token_ids": [1, 2], "finished": False}],
        }
    )
    sample = Checkpoint.from_json(older).samples[0]
    assert sample == SampleState([1, 2], False, 0, None)


def test_logprobs_that_are_not_one_per_token_are_not_trusted() -> None:
    raw = Checkpoint("r", "g", b"", [SampleState([1, 2], logprobs=logprobs(1, 2))]).to_json()
    assert Checkpoint.from_json(raw).samples[0].logprobs is None


def test_packed_logprobs_stay_small() -> None:
    """Per token with 5 alternatives: 44 bytes of float32/uint32, about 60 in base64 —
    where JSON numbers would take about three times that."""
    num_tokens = 512
    with_logprobs = Checkpoint(
        "r", "g", b"", [SampleState(list(range(num_tokens)), logprobs=logprobs(num_tokens, 5))]
    ).to_json()
    without = Checkpoint("r", "g", b"", [SampleState(list(range(num_tokens)))]).to_json()
    assert (len(with_logprobs) - len(without)) / num_tokens < 70
