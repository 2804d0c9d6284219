"""A vision-language request's images in its checkpoint: stored once per image in a real
Valkey, by content, within a size bound, renewed with the record; the record keeps only the
images' SHA-256s."""

from __future__ import annotations

import asyncio
import hashlib

import redis.asyncio as aioredis

from pagemesh.runtime.checkpoints import CheckpointStore, SampleState
from pagemesh.runtime.image_store import ImageStore
from protos.pagemesh.scheduler.v1 import scheduler_pb2
from protos.pagemesh.v1 import generate_pb2
from scheduler_svc import convert
from scheduler_svc.checkpoint import Checkpointer, admitted_samples
from tests.support.eventually import eventually_async


def sha(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


async def with_store(redis_url: str, cluster: str, body) -> None:  # type: ignore[no-untyped-def]
    client = aioredis.from_url(redis_url, decode_responses=True)  # as the services' clients
    store = CheckpointStore(client, cluster)
    try:
        await body(store, client)
    finally:
        await store.images.close()
        await client.aclose()


def test_images_are_stored_once_by_content_within_the_size_bound(redis_url: str) -> None:
    cat, dog, big = b"\x89PNG cat" + bytes(range(256)) * 4, b"\xff\xd8 dog" * 100, b"B" * 5000

    async def body(store: CheckpointStore, client: aioredis.Redis) -> None:
        images: ImageStore = store.images
        assert await images.put({sha(cat): cat, sha(dog): dog}, 30, 6000) == {sha(cat), sha(dog)}
        # The same image again is renewed, not counted twice; one over the bound is refused.
        assert await images.put({sha(cat): cat}, 30, 6000) == {sha(cat)}
        assert await images.stored_bytes() == len(cat) + len(dog)
        assert await images.put({sha(big): big}, 30, 6000) == set()
        found = await images.get_many([sha(cat), sha(big), sha(dog)])
        assert found == {sha(cat): cat, sha(dog): dog}  # bytes exactly, binary-safe
        assert 25_000 < await client.pttl(images.key(sha(cat))) <= 30_000
        assert await images.renew([sha(cat), sha(big)], 60) == {sha(big)}
        assert 55_000 < await client.pttl(images.key(sha(cat))) <= 60_000

    asyncio.run(with_store(redis_url, "img-a", body))


def test_expired_images_leave_room(redis_url: str) -> None:
    first, second = b"1" * 3000, b"2" * 3000

    async def body(store: CheckpointStore, client: aioredis.Redis) -> None:
        assert await store.images.put({sha(first): first}, 0.2, 4000) == {sha(first)}
        assert await store.images.put({sha(second): second}, 30, 4000) == set()
        await asyncio.sleep(0.4)  # the first expired: its bytes no longer count
        assert await store.images.put({sha(second): second}, 30, 4000) == {sha(second)}
        assert await store.images.stored_bytes() == len(second)
        assert await store.images.get_many([sha(first)]) == {}

    asyncio.run(with_store(redis_url, "img-b", body))


def image_submit(request_id: str, images: list[bytes]) -> scheduler_pb2.SubmitRequest:
    return scheduler_pb2.SubmitRequest(
        request_id=request_id,
        prompt_token_ids=list(range(1, 4 + 4 * len(images))),
        sampling=generate_pb2.SamplingParams(temperature=0.0, seed=1),
        stopping=generate_pb2.StoppingCriteria(max_tokens=8),
        images=[
            generate_pb2.ImageInput(data=data, offset=1 + 4 * i, length=4)
            for i, data in enumerate(images)
        ],
    )


def test_a_record_names_its_images_and_the_store_holds_them_once(redis_url: str) -> None:
    cat, dog = b"cat-bytes" * 50, b"dog-bytes" * 70

    async def body(store: CheckpointStore, client: aioredis.Redis) -> None:
        ckpt = Checkpointer(store, "g0", interval_steps=1, resume_window_s=30)
        for request_id, images in (("r1", [cat, dog]), ("r2", [dog])):
            submission = convert.submission_from_pb(image_submit(request_id, images), [0], 0.0)
            ckpt.track(
                request_id, submission.original, admitted_samples(submission), submission.images
            )
        record = await eventually_async(lambda: store.load("r2"), 5, "r2 never checkpointed")
        await eventually_async(lambda: store.load("r1"), 5, "r1 never checkpointed")
        kept = scheduler_pb2.SubmitRequest.FromString(record.submit)
        assert [(i.data, i.sha256, i.offset, i.length) for i in kept.images] == [
            (b"", sha(dog), 1, 4)
        ]
        assert await store.images.stored_bytes() == len(cat) + len(dog)  # dog once
        assert await store.images.get_many([sha(cat), sha(dog)]) == {sha(cat): cat, sha(dog): dog}
        # Redis lost them (restarted empty): the next write of the records stores them again.
        await client.delete(store.images.key(sha(cat)), store.images.key(sha(dog)))
        await ckpt.rewrite_all()
        assert await store.images.get_many([sha(cat), sha(dog)]) == {sha(cat): cat, sha(dog): dog}
        await ckpt.finish_many(["r1", "r2"])
        assert 0 < await client.pttl(store.images.key(sha(dog))) <= 30_000

    asyncio.run(with_store(redis_url, "img-c", body))


def test_an_image_over_the_bound_leaves_the_record_without_it(redis_url: str) -> None:
    small, large = b"s" * 100, b"L" * 10_000

    async def body(store: CheckpointStore, client: aioredis.Redis) -> None:
        ckpt = Checkpointer(
            store, "g0", interval_steps=1, resume_window_s=30, image_store_bytes=1000
        )
        submission = convert.submission_from_pb(image_submit("r1", [small, large]), [0], 0.0)
        ckpt.track("r1", submission.original, [SampleState()], submission.images)
        await eventually_async(lambda: store.load("r1"), 5, "r1 never checkpointed")
        assert await store.images.get_many([sha(small), sha(large)]) == {sha(small): small}
        assert ckpt.num_images_not_stored == 1
        ckpt.on_step()  # later writes do not try (and count) it again
        await ckpt.finish("r1")
        assert ckpt.num_images_not_stored == 1

    asyncio.run(with_store(redis_url, "img-d", body))
