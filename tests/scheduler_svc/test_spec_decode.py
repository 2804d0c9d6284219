"""Speculative decoding in the scheduler core (scheduler_svc/core/spec_decode.py): the
n-gram proposer, vLLM's config, and drafts scheduled, verified and rolled back.

The steps' tokens come from a deterministic stand-in for the model that verifies drafts as
the sampling rank does (worker_svc/spec_verify.py): a token at each drafted position, kept
while the drafts equal them. Whatever is drafted, a scheduler that speculates must give
every request the same tokens as one that does not, with its invariants kept."""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence

import pytest

from pagemesh.runtime.speculative_config import SpeculativeConfig
from protos.step import ModelRunnerOutput, SampledToken, SchedulerOutput
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.core.spec_decode import NgramProposer, Speculation, StepCosts
from scheduler_svc.core.types import FinishReason
from tests.support.core_harness import EOS, check_invariants, make_request

NGRAM = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4)
SUFFIX = SpeculativeConfig(method="suffix", num_speculative_tokens=6)
DRAFT = SpeculativeConfig(method="draft_model", model="/draft", num_speculative_tokens=3)
Model = Callable[[Sequence[int]], int]


def copying_model(tokens: Sequence[int]) -> int:
    """Repeats what came 7 tokens before, except at every 5th position (a surprise), and
    ends (EOS) a sequence at 60 tokens."""
    if len(tokens) >= 60:
        return EOS
    if len(tokens) % 5 == 0:
        return 100 + len(tokens) % 13
    return tokens[-7]


def drafting_model(tokens: Sequence[int]) -> int:
    """A draft of `copying_model` that never foresees its surprises."""
    return tokens[-7] if len(tokens) >= 7 else tokens[-1]


def verifying_step(
    scheduler: Scheduler, output: SchedulerOutput, model: Model
) -> ModelRunnerOutput:
    """What the sampling rank returns: a token after each request's known tokens, and one
    more per draft equal to the token drawn before it; with a draft model, each sampled
    request's next drafts."""
    result = ModelRunnerOutput(output.step_id)
    drafts = {c.request_id: c.spec_token_ids for c in output.cached_requests}
    for request_id in output.num_scheduled_tokens:
        request = scheduler.requests[request_id]
        mine = drafts.get(request_id, [])
        if request.num_computed_tokens - len(mine) != request.num_tokens:
            continue  # a prefill chunk that does not reach the end
        tokens = list(request.all_token_ids)
        drawn = [model(tokens)]
        for draft in mine:
            if drawn[-1] != draft:
                break
            tokens.append(draft)
            drawn.append(model(tokens))
        result.sampled[request_id] = SampledToken(drawn[0])
        if mine:
            result.spec_sampled[request_id] = [SampledToken(t) for t in drawn[1:]]
        config = scheduler.config.speculative
        if config is not None and config.method == "draft_model":
            known = [*request.all_token_ids, *drawn]
            for _ in range(config.num_speculative_tokens):
                known.append(drafting_model(known))
            result.draft_token_ids[request_id] = known[-config.num_speculative_tokens :]
    return result


def run(scheduler: Scheduler, model: Model, max_steps: int = 2000) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_work():
            return outputs
        output = scheduler.schedule()
        check_invariants(scheduler)
        for event in scheduler.update(output, verifying_step(scheduler, output, model)):
            outputs.setdefault(event.request_id, []).extend(t.token_id for t in event.new_tokens)
        check_invariants(scheduler)
    raise AssertionError("did not finish")


def test_the_proposer_follows_the_longest_latest_match() -> None:
    proposer = NgramProposer(NGRAM)
    #          0  1  2  3  4  5  6  7  8  9 10 11
    prompt = [1, 2, 3, 9, 1, 2, 3, 8, 5, 2, 3]
    # "2 3" ends the tokens; "1 2 3" does not end them, so the longest match is "2 3" (len 2)
    # and its latest earlier occurrence is at 5..6: 8, 5, 2, 3 follow.
    assert proposer.propose("r", prompt, [], 4) == [8, 5, 2, 3]
    assert proposer.propose("r", prompt, [], 2) == [8, 5]
    # Output extends the tokens incrementally: "... 3 9" matches 2..3 -> 1 2 3 9.
    assert proposer.propose("r", prompt, [9], 4) == [1, 2, 3, 8]
    assert proposer.propose("r", prompt, [9, 7], 4) == []  # "9 7" never occurred
    assert proposer.propose("r", [5, 6], [], 4) == []  # shorter: started over, no match
    assert proposer.propose("r", prompt, [], 0) == []


def test_the_draft_length_halves_on_rejection_and_doubles_back() -> None:
    proposer = NgramProposer(NGRAM)
    assert proposer.max_drafts("r") == 4
    proposer.observe("r", 4, 0)
    proposer.observe("r", 2, 0)
    assert proposer.max_drafts("r") == 1
    proposer.observe("r", 1, 0)
    assert proposer.max_drafts("r") == 1  # never below one
    proposer.observe("r", 1, 1)
    proposer.observe("r", 2, 1)  # some kept: unchanged
    assert proposer.max_drafts("r") == 2
    proposer.observe("r", 2, 2)
    proposer.observe("r", 4, 4)
    assert proposer.max_drafts("r") == 4
    proposer.forget("r")
    assert proposer.max_drafts("r") == 4


def test_steps_that_keep_no_draft_pause_drafting_longer_each_time() -> None:
    """Whatever the method: from the second step in a row that kept none of a request's
    drafts, it skips drafting for 1, 2, 4, ... 16 steps; a kept draft ends the back-off."""
    config = SchedulerConfig(num_blocks=64, block_size=4, max_model_len=64, speculative=NGRAM)
    spec = Speculation(config)
    request = make_request("r", prompt=[1, 2, 3, 4, 1, 2, 3], max_tokens=40)
    request.num_computed_tokens = request.num_tokens - 1

    def verdict(kept: int) -> None:
        request.spec_token_ids = [4, 1, 2, 3]
        request.num_computed_tokens += 4
        spec.verified(
            request, SampledToken(4 if kept else 9), [SampledToken(t) for t in [1, 2, 3, 4][:kept]]
        )
        request.num_computed_tokens = request.num_tokens - 1  # as if the tokens were taken

    def drafted(steps: int) -> list[bool]:
        return [bool(spec.drafts(request, 64)) for _ in range(steps)]

    verdict(0)
    assert drafted(1) == [True]  # one miss: no pause
    verdict(0)
    assert drafted(2) == [False, True]
    verdict(0)
    assert drafted(3) == [False, False, True]
    verdict(0)
    assert drafted(5) == [False] * 4 + [True]
    verdict(1)  # kept one: drafting goes on, and the next misses start over
    verdict(0)
    verdict(0)
    assert drafted(2) == [False, True]


def test_the_config_is_vllms_and_refuses_by_name() -> None:
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse("") is None
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (5, 5)  # vLLM's default
    assert (
        SpeculativeConfig.parse(
            {"num_speculative_tokens": 2, "prompt_lookup_max": 3}
        ).prompt_lookup_min
        == 3
    )
    for bad, needle in (
        ({"method": "eagle", "num_speculative_tokens": 2}, "not served"),
        ({"method": "ngram"}, "num_speculative_tokens >= 1"),
        (
            {"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "1 <= min <= max",
        ),
        ({"num_speculative_tokens": 2, "lookahead": 3}, "unknown"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, 'needs "model"'),
        (
            {"model": "/d", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2},
            "draft_tensor_parallel_size",
        ),
        ("{not json", "not JSON"),
        ("[1]", "JSON object"),
    ):
        with pytest.raises(ValueError, match=needle):
            SpeculativeConfig.parse(bad)
    with pytest.raises(ValueError, match="async scheduling is off while speculating"):
        SchedulerConfig(num_blocks=8, async_scheduling=True, speculative=config)
    assert (
        SpeculativeConfig.parse({"model": "/d", "num_speculative_tokens": 3}).method
        == "draft_model"
    )  # vLLM infers it from the model
    suffix = SpeculativeConfig.parse({"method": "suffix"})
    assert suffix.num_speculative_tokens == 24  # vLLM's: up to the tree's depth
    for bad, needle in (
        ({"method": "suffix", "suffix_decoding_min_token_prob": 2}, "[0, 1]"),
        ({"method": "suffix", "suffix_decoding_max_tree_depth": 0}, ">= 1"),
    ):
        with pytest.raises(ValueError, match=re.escape(needle)):
            SpeculativeConfig.parse(bad)
    # Drafts span blocks (24 > the block size is fine); they must fit a step and the cache.
    SchedulerConfig(num_blocks=64, block_size=16, speculative=suffix)
    with pytest.raises(ValueError, match="does not fit a step"):
        SchedulerConfig(num_blocks=64, max_num_batched_tokens=16, speculative=suffix)
    with pytest.raises(ValueError, match="KV cache"):
        SchedulerConfig(num_blocks=2, block_size=4, speculative=suffix)


def test_drafts_are_scheduled_verified_and_rolled_back() -> None:
    scheduler = Scheduler(
        SchedulerConfig(num_blocks=16, block_size=4, max_model_len=64, speculative=NGRAM)
    )
    prompt = [31, 32, 33, 34, 35, 36, 37, 31, 32]  # "31 32" occurred: drafts 33 34 35 36
    scheduler.add_request(make_request("a", prompt=prompt, max_tokens=20))
    output = scheduler.schedule()  # the prefill: no drafts
    assert output.num_scheduled_tokens == {"a": 9}
    scheduler.update(output, ModelRunnerOutput(output.step_id, {"a": SampledToken(33)}))
    output = scheduler.schedule()  # "32 33" -> 34 35 36 37
    assert output.cached_requests[0].spec_token_ids == [34, 35, 36, 37]
    assert output.num_scheduled_tokens == {"a": 5}
    request = scheduler.requests["a"]
    assert request.num_computed_tokens == 14
    # Two drafts kept, the third differs: tokens 34 35 then 99; KV kept through 35.
    events = scheduler.update(
        output,
        ModelRunnerOutput(
            output.step_id, {"a": SampledToken(34)}, {"a": [SampledToken(35), SampledToken(99)]}
        ),
    )
    assert [t.token_id for t in events[0].new_tokens] == [34, 35, 99]
    assert (events[0].num_draft_tokens, events[0].num_accepted_tokens) == (4, 2)
    assert request.output_token_ids == [33, 34, 35, 99]
    assert request.num_computed_tokens == request.num_tokens - 1 == 12
    stats = scheduler.stats()
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 4, 2)
    assert (request.num_draft_tokens, request.num_accepted_tokens) == (4, 2)
    check_invariants(scheduler)
    # The next step sends the three new tokens and no drafts ("35 99" never occurred).
    output = scheduler.schedule()
    assert output.cached_requests[0].new_token_ids == [34, 35, 99]
    assert output.cached_requests[0].spec_token_ids == []


def test_a_stop_among_kept_drafts_ends_the_request_there() -> None:
    scheduler = Scheduler(
        SchedulerConfig(num_blocks=16, block_size=4, max_model_len=64, speculative=NGRAM)
    )
    scheduler.add_request(make_request("a", prompt=[5, 6, EOS, 8, 9], max_tokens=20))
    output = scheduler.schedule()
    scheduler.update(output, ModelRunnerOutput(output.step_id, {"a": SampledToken(5)}))
    output = scheduler.schedule()
    # "9 5" is new, "5" alone is too short: no drafts. Then "5 6" -> EOS 8 9 5.
    assert output.cached_requests[0].spec_token_ids == []
    scheduler.update(output, ModelRunnerOutput(output.step_id, {"a": SampledToken(6)}))
    output = scheduler.schedule()
    assert output.cached_requests[0].spec_token_ids == [EOS, 8, 9, 5]
    events = scheduler.update(
        output,
        ModelRunnerOutput(output.step_id, {"a": SampledToken(EOS)}, {"a": [SampledToken(8)]}),
    )
    assert [t.token_id for t in events[0].new_tokens] == [EOS]
    assert events[0].finish_reason is FinishReason.STOP
    assert scheduler.kv.pool.num_free_blocks == 16


def test_drafts_stay_within_max_tokens_and_the_budget() -> None:
    scheduler = Scheduler(
        SchedulerConfig(
            num_blocks=32,
            block_size=4,
            max_model_len=64,
            max_num_batched_tokens=12,
            speculative=NGRAM,
        )
    )
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]
    scheduler.add_request(make_request("a", prompt=prompt, max_tokens=3))
    output = scheduler.schedule()
    scheduler.update(output, ModelRunnerOutput(output.step_id, {"a": SampledToken(3)}))
    output = scheduler.schedule()  # two tokens left to make: one drawn, one draft at most
    assert output.cached_requests[0].spec_token_ids == [4]


@pytest.mark.parametrize("seed", range(6))
def test_speculating_changes_no_token_under_load(seed: int) -> None:
    """Many requests with copy-prone prompts, a cache small enough to preempt (recompute
    and swap), prefix caching, chunked prefill, EOS and max_tokens stops: the same tokens
    per request with and without drafts, and drafts both kept and rejected."""
    rng = random.Random(seed)
    motifs = [[rng.randrange(20, 90) for _ in range(7)] for _ in range(3)]
    requests = []
    for i in range(10):
        motif = motifs[i % 3]
        prompt = (motif * 4)[: rng.randrange(9, 26)] + [rng.randrange(20, 90)]
        requests.append((f"r{i}", prompt, rng.randrange(1, 40)))
    outputs = []
    for speculative in (None, NGRAM, SUFFIX, DRAFT):
        config = SchedulerConfig(
            num_blocks=24,
            block_size=4,
            max_model_len=64,
            max_num_batched_tokens=24,
            speculative=speculative,
            num_swap_blocks=8 if seed % 2 else 0,
        )
        scheduler = Scheduler(config)
        for request_id, prompt, max_tokens in requests:
            scheduler.add_request(make_request(request_id, prompt=prompt, max_tokens=max_tokens))
        outputs.append(run(scheduler, copying_model))
        if speculative is not None:
            stats = scheduler.stats()
            assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert outputs[0] == outputs[1] == outputs[2] == outputs[3]


def test_kept_drafts_that_differ_from_the_draws_are_refused() -> None:
    """A kept draft's KV was computed with the draft: it must be the token drawn before it."""
    scheduler = Scheduler(
        SchedulerConfig(num_blocks=16, block_size=4, max_model_len=64, speculative=NGRAM)
    )
    scheduler.add_request(make_request("a", prompt=[31, 32, 33, 34, 35, 31, 32], max_tokens=9))
    output = scheduler.schedule()
    scheduler.update(output, ModelRunnerOutput(output.step_id, {"a": SampledToken(33)}))
    output = scheduler.schedule()
    assert output.cached_requests[0].spec_token_ids == [34, 35, 31, 32]
    with pytest.raises(ValueError, match="drafts kept"):
        scheduler.update(
            output,
            ModelRunnerOutput(output.step_id, {"a": SampledToken(99)}, {"a": [SampledToken(35)]}),
        )


def test_drafting_stops_at_a_batch_size_where_drafted_steps_give_fewer_tokens_per_ms() -> None:
    """Measured step times decide per batch size (bucket): drafted steps slower per token
    than plain ones -> one step in 8 drafts (to keep measuring); unmeasured or faster ->
    every step drafts; scripted steps (no time) change nothing."""
    costs = StepCosts()
    assert all(costs.pays(8) for _ in range(10))  # nothing measured yet
    costs.observe(8, drafted=False, num_tokens=8, ms=40.0)  # 0.2 tokens per ms
    costs.observe(8, drafted=True, num_tokens=9, ms=50.0)  # 0.18: drafting costs here
    costs.observe(8, drafted=True, num_tokens=9, ms=0.0)  # unmeasured: ignored
    verdicts = [costs.pays(8) for _ in range(16)]
    assert sum(verdicts) == 2
    assert all(costs.pays(1) for _ in range(4))  # batch 1 is another bucket: unmeasured
    costs.observe(1, drafted=False, num_tokens=1, ms=25.0)
    costs.observe(1, drafted=True, num_tokens=3, ms=30.0)  # 0.1 vs 0.04: drafting pays
    assert all(costs.pays(1) for _ in range(4))
    for _ in range(40):  # drafted steps get faster at batch 8: drafting comes back
        costs.observe(8, drafted=True, num_tokens=12, ms=45.0)
    assert all(costs.pays(8) for _ in range(4))
