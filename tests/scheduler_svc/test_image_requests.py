"""Vision-language prompts in the scheduler core: an image's content is part of the block
hashes, so a prompt with another image behind the same placeholder tokens never shares KV,
while the same image does; and the images travel with the request to the workers, again
after a preemption."""

from __future__ import annotations

from protos.step import ImageInput
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from tests.support.core_harness import check_invariants, fake_step, make_request

PLACEHOLDER = 5
PROMPT = [PLACEHOLDER] * 12 + list(range(20, 32))  # 12 image tokens, then 12 of text


def with_image(request_id: str, data: bytes):
    return make_request(request_id, prompt=PROMPT, max_tokens=2, images=(ImageInput(data, 0, 12),))


def hits_after(first: bytes, second: bytes) -> int:
    scheduler = Scheduler(SchedulerConfig(num_blocks=32, block_size=4, max_model_len=64))
    scheduler.add_request(with_image("a", first))
    while scheduler.has_work():
        output = scheduler.schedule()
        scheduler.update(output, fake_step(scheduler, output))
        check_invariants(scheduler)
    scheduler.add_request(with_image("b", second))
    output = scheduler.schedule()
    assert output.new_requests[0].images == (ImageInput(second, 0, 12),)
    return output.new_requests[0].num_computed_tokens


def test_the_same_image_shares_kv_and_another_image_does_not() -> None:
    assert hits_after(b"cat.png", b"cat.png") == 20  # 5 full blocks of the 23 cacheable
    assert hits_after(b"cat.png", b"dog.png") == 0


def test_a_preempted_image_request_is_resent_with_its_images() -> None:
    # Two prompts of 8 (4 image tokens) growing to 20 tokens (5 blocks) each in 8 blocks.
    scheduler = Scheduler(
        SchedulerConfig(num_blocks=8, block_size=4, max_model_len=64, preemption_mode="recompute")
    )
    for request_id, data in (("a", b"one"), ("b", b"two")):
        scheduler.add_request(
            make_request(
                request_id,
                prompt=[PLACEHOLDER] * 4 + [7, 8, 9, 10],
                max_tokens=12,
                images=(ImageInput(data, 0, 4),),
            )
        )
    sent = []
    for _ in range(40):
        if not scheduler.has_work():
            break
        output = scheduler.schedule()
        sent += [(new.request_id, new.images[0].data) for new in output.new_requests]
        scheduler.update(output, fake_step(scheduler, output))
    assert scheduler.num_preemptions >= 1
    assert sent.count(("b", b"two")) >= 2 or sent.count(("a", b"one")) >= 2
