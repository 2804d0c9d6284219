"""LoRA in the scheduler core: the adapter is part of the block hashes (two adapters, or an
adapter and the base, never share KV; the same adapter does), a step holds at most
`max_loras` adapters (the others wait their turn, in order), and the adapter travels with the
request to the workers, again after a preemption."""

from __future__ import annotations

import pytest

from protos.block_hash import adapter_extra, hash_request_blocks
from protos.step import LoraRef
from scheduler_svc.core.admission import check_admissible
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from tests.support.core_harness import check_invariants, fake_step, make_request

PROMPT = list(range(20, 44))  # 6 blocks of 4
A, B = LoraRef("a", "/adapters/a"), LoraRef("b", "/adapters/b")


def run(scheduler: Scheduler) -> None:
    while scheduler.has_work():
        output = scheduler.schedule()
        scheduler.update(output, fake_step(scheduler, output))
        check_invariants(scheduler)


def hits_after(first: LoraRef | None, second: LoraRef | None) -> int:
    scheduler = Scheduler(
        SchedulerConfig(num_blocks=32, block_size=4, max_model_len=64, max_loras=2)
    )
    scheduler.add_request(make_request("one", prompt=PROMPT, max_tokens=2, lora=first))
    run(scheduler)
    scheduler.add_request(make_request("two", prompt=PROMPT, max_tokens=2, lora=second))
    output = scheduler.schedule()
    assert output.new_requests[0].lora == second
    return output.new_requests[0].num_computed_tokens


def test_the_same_adapter_shares_kv_and_another_does_not() -> None:
    assert hits_after(A, A) == 20  # 5 of the 6 blocks (the last token is always computed)
    assert hits_after(None, None) == 20
    assert hits_after(A, B) == 0
    assert hits_after(A, None) == 0
    assert hits_after(None, A) == 0
    # The router hashes alike (prefix-aware routing): the scheduler's extra bytes.
    assert hash_request_blocks(PROMPT, 4, adapter_extra("a")) != hash_request_blocks(PROMPT, 4)


def test_a_step_holds_at_most_max_loras_adapters() -> None:
    scheduler = Scheduler(
        SchedulerConfig(num_blocks=64, block_size=4, max_model_len=64, max_loras=2)
    )
    adapters = [LoraRef(f"l{i}", f"/adapters/l{i}") for i in range(4)]
    for i, lora in enumerate([*adapters, None, adapters[0]]):
        scheduler.add_request(make_request(f"r{i}", prompt_len=6, max_tokens=3, lora=lora))
    seen_together = []
    while scheduler.has_work():
        output = scheduler.schedule()
        running = {r.lora.name for r in scheduler.running if r.lora is not None}
        assert len(running) <= 2
        seen_together.append(running)
        scheduler.update(output, fake_step(scheduler, output))
    assert {"l0", "l1"} in seen_together and any("l3" in s for s in seen_together)


def test_lora_off_refuses_a_request_naming_an_adapter() -> None:
    config = SchedulerConfig(num_blocks=8)
    with pytest.raises(ValueError, match="LoRA is off"):
        check_admissible(make_request("x", prompt_len=4, lora=A), config, set())


def test_a_preempted_request_is_resent_with_its_adapter() -> None:
    scheduler = Scheduler(
        SchedulerConfig(
            num_blocks=8, block_size=4, max_model_len=64, preemption_mode="recompute", max_loras=2
        )
    )
    for request_id, lora in (("x", A), ("y", B)):
        scheduler.add_request(make_request(request_id, prompt_len=8, max_tokens=12, lora=lora))
    sent = []
    for _ in range(60):
        if not scheduler.has_work():
            break
        output = scheduler.schedule()
        sent += [(new.request_id, new.lora) for new in output.new_requests]
        scheduler.update(output, fake_step(scheduler, output))
    assert scheduler.num_preemptions >= 1
    assert all(lora == (A if rid == "x" else B) for rid, lora in sent)
    assert len(sent) > 2
