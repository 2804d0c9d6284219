"""The scheduler core driven directly: schedule(), a made-up step result, update()."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

from protos.pagemesh.scheduler.v1 import scheduler_pb2
from protos.pagemesh.v1 import generate_pb2
from protos.step import RequestId
from scheduler_svc import convert
from scheduler_svc.core.scheduler import CapacityError, Scheduler, SchedulerConfig
from scheduler_svc.core.types import FinishReason
from tests.support.core_harness import (
    EOS,
    check_invariants,
    fake_step,
    make_request,
    run_to_completion,
)
from tests.support.paths import REPO_ROOT


def test_prefill_then_decode_until_max_tokens() -> None:
    scheduler = Scheduler(SchedulerConfig(num_blocks=10, block_size=4, max_model_len=64))
    scheduler.add_request(make_request("a", prompt_len=6, max_tokens=4))
    out = scheduler.schedule()
    assert [n.request_id for n in out.new_requests] == ["a"]
    assert out.num_scheduled_tokens == {"a": 6}
    assert out.new_requests[0].block_ids == [0, 1]
    events = scheduler.update(out, fake_step(scheduler, out))
    assert events[0].new_tokens[0].token_id == 7 and events[0].finish_reason is None
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 1} and not out.new_requests
    assert out.cached_requests[0].new_block_ids == []
    scheduler.update(out, fake_step(scheduler, out))
    out = scheduler.schedule()  # the 8th token still fits in two blocks
    assert out.cached_requests[0].new_block_ids == []
    scheduler.update(out, fake_step(scheduler, out))
    out = scheduler.schedule()  # the 9th token needs a third block
    assert out.cached_requests[0].new_block_ids == [2]
    events = scheduler.update(out, fake_step(scheduler, out))
    assert events[0].finish_reason is FinishReason.LENGTH
    assert scheduler.kv.pool.num_free_blocks == 10
    out = scheduler.schedule()
    assert out.finished_request_ids == ["a"] and not out.num_scheduled_tokens


def test_eos_stops_only_after_min_tokens() -> None:
    scheduler = Scheduler(SchedulerConfig(num_blocks=10, block_size=4, max_model_len=64))
    scheduler.add_request(make_request("a", prompt_len=3, max_tokens=10, min_tokens=2))
    reasons = []
    for _ in range(2):
        out = scheduler.schedule()
        events = scheduler.update(out, fake_step(scheduler, out, {"a": EOS}))
        reasons.append(events[0].finish_reason)
    assert reasons == [None, FinishReason.STOP]
    assert not scheduler.has_work() or not scheduler.schedule().num_scheduled_tokens


def test_eos_as_the_max_tokens_th_token_ends_stop_live_and_when_resumed() -> None:
    """One stop rule: the live path and a resume over the same outputs agree (vLLM: STOP)."""
    scheduler = Scheduler(SchedulerConfig(num_blocks=10, block_size=4, max_model_len=64))
    scheduler.add_request(make_request("a", prompt_len=3, max_tokens=2))
    reasons = []
    for token in (7, EOS):
        out = scheduler.schedule()
        reasons.append(
            scheduler.update(out, fake_step(scheduler, out, {"a": token}))[0].finish_reason
        )
    assert reasons == [None, FinishReason.STOP]

    resumed = scheduler_pb2.SubmitRequest(
        request_id="a",
        prompt_token_ids=[10, 11, 12],
        n=2,
        sampling=generate_pb2.SamplingParams(seed=3),
        stopping=generate_pb2.StoppingCriteria(max_tokens=2),
    )
    resumed.progress.add(index=0, token_ids=[7, EOS])  # its last message was lost
    resumed.progress.add(index=1, token_ids=[7, 7])
    submission = convert.submission_from_pb(resumed, [EOS], 0.0)
    assert submission.requests == []
    assert submission.ended == [(0, FinishReason.STOP), (1, FinishReason.LENGTH)]


def test_a_submit_without_a_seed_is_refused() -> None:
    """The router draws every seed; a scheduler that drew its own could not resume the same."""
    unseeded = scheduler_pb2.SubmitRequest(
        request_id="a", prompt_token_ids=[1], stopping=generate_pb2.StoppingCriteria(max_tokens=2)
    )
    with pytest.raises(ValueError, match="seed"):
        convert.submission_from_pb(unseeded, [EOS], 0.0)


def test_token_budget_is_shared_and_prefill_is_chunked() -> None:
    config = SchedulerConfig(
        num_blocks=64, block_size=4, max_num_batched_tokens=8, max_model_len=64
    )
    scheduler = Scheduler(config)
    scheduler.add_request(make_request("long", prompt_len=20))
    scheduler.add_request(make_request("short", prompt_len=3))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"long": 8}
    scheduler.update(out, fake_step(scheduler, out))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"long": 8}
    scheduler.update(out, fake_step(scheduler, out))
    out = scheduler.schedule()  # last 4 of the long prompt, then the short one shares the step
    assert out.num_scheduled_tokens == {"long": 4, "short": 3}
    assert out.total_num_scheduled_tokens <= 8
    events = scheduler.update(out, fake_step(scheduler, out))
    assert {e.request_id for e in events} == {"long", "short"}


def test_max_num_seqs_caps_the_running_batch() -> None:
    scheduler = Scheduler(
        SchedulerConfig(num_blocks=64, block_size=4, max_num_seqs=2, max_model_len=64)
    )
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", prompt_len=2))
    out = scheduler.schedule()
    assert set(out.num_scheduled_tokens) == {"r0", "r1"}
    assert len(scheduler.waiting) == 1


def test_preemption_recomputes_newest_request_and_everything_finishes() -> None:
    # 6 blocks of 4 tokens; three requests growing to 12 tokens each cannot all fit.
    scheduler = Scheduler(SchedulerConfig(num_blocks=6, block_size=4, max_model_len=64))
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", prompt_len=4, max_tokens=8))
    outputs = run_to_completion(scheduler)
    assert scheduler.num_preemptions > 0
    assert {k: len(v) for k, v in outputs.items()} == {"r0": 8, "r1": 8, "r2": 8}
    assert scheduler.kv.pool.num_free_blocks == 6


def test_preempted_request_is_resent_in_full_with_its_output() -> None:
    scheduler = Scheduler(
        SchedulerConfig(num_blocks=3, block_size=4, max_model_len=64, enable_prefix_caching=False)
    )
    scheduler.add_request(make_request("old", prompt_len=4, max_tokens=6))
    scheduler.add_request(make_request("new", prompt_len=4, max_tokens=6))
    resent = None
    for _ in range(40):
        if not scheduler.has_work():
            break
        out = scheduler.schedule()
        for new in out.new_requests:
            if new.request_id == "new" and new.num_prompt_tokens < len(new.token_ids):
                resent = new
        scheduler.update(out, fake_step(scheduler, out))
        check_invariants(scheduler)
    assert resent is not None, "the newest request was never preempted and resent"
    assert resent.token_ids[:4] == list(range(10, 14)) and resent.num_computed_tokens == 0


def test_abort_between_steps_frees_blocks_at_once() -> None:
    scheduler = Scheduler(SchedulerConfig(num_blocks=8, block_size=4, max_model_len=64))
    scheduler.add_request(make_request("a", prompt_len=9, max_tokens=5))
    out = scheduler.schedule()
    scheduler.update(out, fake_step(scheduler, out))
    event = scheduler.abort(RequestId("a"))
    assert event is not None and event.finish_reason is FinishReason.ABORT
    assert scheduler.kv.pool.num_free_blocks == 8
    assert scheduler.schedule().finished_request_ids == ["a"]


def test_abort_during_a_step_waits_for_update() -> None:
    scheduler = Scheduler(SchedulerConfig(num_blocks=8, block_size=4, max_model_len=64))
    scheduler.add_request(make_request("a", prompt_len=9, max_tokens=5))
    out = scheduler.schedule()
    assert scheduler.abort(RequestId("a")) is None  # the step is in flight
    assert scheduler.kv.pool.num_free_blocks < 8
    events = scheduler.update(out, fake_step(scheduler, out))
    assert events[-1].finish_reason is FinishReason.ABORT
    assert scheduler.kv.pool.num_free_blocks == 8
    assert "a" not in scheduler.requests


def test_rejects_requests_that_can_never_fit() -> None:
    scheduler = Scheduler(SchedulerConfig(num_blocks=2, block_size=4, max_model_len=64))
    with pytest.raises(CapacityError, match="KV blocks"):
        scheduler.add_request(make_request("big", prompt_len=6, max_tokens=4))
    with pytest.raises(ValueError, match="max_model_len"):
        scheduler.add_request(make_request("long", prompt_len=60, max_tokens=8))
    scheduler.add_request(make_request("ok", prompt_len=3, max_tokens=2))
    with pytest.raises(ValueError, match="already in flight"):
        scheduler.add_request(make_request("ok", prompt_len=3, max_tokens=2))


def test_many_requests_random_lengths_keep_invariants() -> None:
    scheduler = Scheduler(
        SchedulerConfig(
            num_blocks=24, block_size=4, max_num_batched_tokens=16, max_num_seqs=5, max_model_len=64
        )
    )
    lengths = itertools.cycle([1, 5, 13, 2, 8, 17])
    for i in range(20):
        scheduler.add_request(make_request(f"r{i}", prompt_len=next(lengths), max_tokens=1 + i % 7))
    outputs = run_to_completion(scheduler)
    assert {k: len(v) for k, v in outputs.items()} == {f"r{i}": 1 + i % 7 for i in range(20)}
    assert scheduler.kv.pool.num_free_blocks == 24


def _imported_modules(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append(node.module or "")
    return names


def test_core_imports_no_grpc_or_torch() -> None:
    """The core is plain Python; of `protos` it may use only the stdlib-only block hash and
    step contract."""
    root = REPO_ROOT
    pure = {"protos.block_hash", "protos.step"}
    for path in (root / "scheduler_svc" / "core").glob("*.py"):
        for name in _imported_modules(path):
            if name in pure:
                continue
            assert name.split(".")[0] not in {"grpc", "torch", "redis", "protos"}, (path, name)
    for module in pure:
        for name in _imported_modules(root / (module.replace(".", "/") + ".py")):
            assert name.split(".")[0] in {
                "__future__",
                "hashlib",
                "struct",
                "collections",
                "typing",
                "dataclasses",
            }, (module, name)
