"""--stream-interval N: the router coalesces up to N tokens of a sample per client message,
and the client still gets every token, in order, with the finish reason and usage — also
across a group failing mid-stream."""

from __future__ import annotations

import pytest

from pagemesh.runtime.tokenizer import Tokenizer, load_tokenizer
from router.generation import AdmissionLimits
from tests.support.bpe_folder import write_bpe_folder
from tests.support.scripted_router import LENGTH, Router, expected, per_sample, request, run


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return load_tokenizer(str(write_bpe_folder(tmp_path_factory.mktemp("bpe"))))


@pytest.mark.parametrize("interval", [1, 4])
def test_tokens_are_coalesced_per_message(
    tokenizer: Tokenizer, redis_url: str, interval: int
) -> None:
    async def scenario() -> None:
        async with Router(
            tokenizer, redis_url, limits=AdmissionLimits(stream_interval=interval)
        ) as router:
            for name in ("a", "b"):
                scheduler = await router.add_scheduler(name)
                scheduler.fail_after_tokens = 5  # one of them fails mid-stream
                scheduler.failure_budget = [1]
            responses = await router.generate(request(tokenizer, 10, n=2))
            for index, (ids, text, reason) in enumerate(per_sample(responses, 2)):
                assert ids == expected(tokenizer, 10, index)
                assert text == tokenizer.decode(ids) and reason == LENGTH
            sizes = [len(r.token_ids) for r in responses if r.token_ids]
            assert max(sizes) <= interval
            if interval > 1:  # every message full but each sample's last
                assert sorted(sizes) == [2, 2, 4, 4, 4, 4]
            assert responses[-1].usage.completion_tokens == 20

    run(scenario())


def test_a_stream_interval_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="stream_interval"):
        AdmissionLimits(stream_interval=0)
