"""The scheduler's checkpoints: every in-flight request's progress, kept in Redis so that
whatever dies (router, scheduler, worker), the request resumes where it was.

Written on admission, every `interval` steps (the requests that got tokens since), when a
request finishes (before its last message goes out, so the record is complete when the
router reads it) and when it loses its router (orphaned). Finished and orphaned records
expire after the resume window; the router deletes a record once its client has it all.
A running request's record expires too, a resume window after it was last written or
renewed: this scheduler renews its requests' records while they run, so the record of a
request nobody runs any more (its scheduler gone for good) does not stay forever. The
group's id set is pruned of expired ids as often.
A vision-language request's images go to the image store (pagemesh/runtime/image_store.py) before
its first record, once per image; every later write of the record renews them (and stores
them again when Redis lost them), so they live as long as the record can be resumed.
Writes never hold up the step loop: periodic ones run in the background, one at a time,
and every write is bounded by a timeout — Redis being away costs checkpoints, not steps.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from pagemesh.runtime.checkpoints import (
    FINISHED,
    ORPHANED,
    RUNNING,
    Checkpoint,
    CheckpointStore,
    SampleState,
)
from protos.step import ImageInput
from scheduler_svc import convert
from scheduler_svc.core.types import RequestEvent
from scheduler_svc.messages import Submission

logger = logging.getLogger(__name__)

WRITE_TIMEOUT_S = 1.0


@dataclass
class _Tracked:
    checkpoint: Checkpoint
    dirty: bool = True
    images: dict[bytes, bytes] = field(default_factory=dict)  # SHA-256 -> encoded image


def admitted_samples(submission: Submission) -> list[SampleState]:
    """A request's checkpoint samples at admission: a resume's progress, with its logprobs
    when the request asks for them and they came for every token (else none are kept)."""
    with_logprobs = submission.with_logprobs
    samples = [SampleState(logprobs=[] if with_logprobs else None) for _ in range(submission.n)]
    for index, (token_ids, finished) in submission.progress.items():
        logprobs = submission.progress_logprobs.get(index) if with_logprobs else None
        samples[index] = SampleState(list(token_ids), finished, logprobs=logprobs)
    return samples


class Checkpointer:
    def __init__(
        self,
        store: CheckpointStore | None,
        group: str,
        interval_steps: int,
        resume_window_s: float,
        image_store_bytes: int = 1 << 30,
    ) -> None:
        """`store` None or `interval_steps` 0: checkpoints off. `image_store_bytes`: the
        most bytes of images the image store holds, every group's together."""
        self.store = store if interval_steps > 0 else None
        self.group = group
        self.interval_steps = interval_steps
        self.resume_window_s = resume_window_s
        self.image_store_bytes = image_store_bytes
        self.num_images_not_stored = 0  # images the store had no room for, since start
        self._tracked: dict[str, _Tracked] = {}
        self._steps = 0
        self._flushing: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._renewed_at = time.monotonic()
        self._failing = False  # the last write failed: Redis is away
        self.num_writes = 0  # records written
        self.write_time_s = 0.0  # wall time of the writes, for the benchmark

    @property
    def enabled(self) -> bool:
        return self.store is not None

    def track(
        self,
        request_id: str,
        submit: bytes,
        samples: list[SampleState],
        images: tuple[ImageInput, ...] = (),
    ) -> None:
        """Admission: the record (its images first) written now, in the background."""
        if self.store is None:
            return
        ckpt = Checkpoint(request_id, self.group, submit, samples, RUNNING)
        tracked = _Tracked(ckpt, images={image.digest: image.data for image in images})
        self._tracked[request_id] = tracked
        self._spawn(self._write([tracked], self.resume_window_s))

    def record(self, request_id: str, index: int, event: RequestEvent) -> None:
        """Sample `index`'s new tokens (with their logprobs when the sample keeps them), and
        its end (kept as the protobuf enum's value, which the router reads back)."""
        tracked = self._tracked.get(request_id)
        if tracked is None:
            return
        sample = tracked.checkpoint.samples[index]
        sample.token_ids.extend([t.token_id for t in event.new_tokens])
        if sample.logprobs is not None:  # the request asked for them
            sample.logprobs.extend([(t.logprob, t.top_logprobs) for t in event.new_tokens])
        if event.finish_reason is not None:
            sample.finished = True
            sample.finish_reason = convert.finish_reason_to_pb(event.finish_reason)
        tracked.dirty = True

    async def finish(self, request_id: str) -> None:
        """Every sample ended: the complete record, with the resume window as its TTL."""
        await self.finish_many([request_id])

    async def finish_many(self, request_ids: list[str]) -> None:
        """`finish` for several requests (one step's), in one round trip."""
        done = []
        for request_id in request_ids:
            tracked = self._tracked.pop(request_id, None)
            if tracked is not None:
                tracked.checkpoint.state = FINISHED
                done.append(tracked)
        if self._failing:  # Redis away: the last messages must not wait a timeout for it
            self._spawn(self._write(done, self.resume_window_s))
            return
        await self._write(done, self.resume_window_s)

    def orphan(self, request_id: str) -> None:
        """Its router went away (or this scheduler drains): kept for the resume window."""
        tracked = self._tracked.pop(request_id, None)
        if tracked is not None:
            tracked.checkpoint.state = ORPHANED
            self._spawn(self._write([tracked], self.resume_window_s))

    def on_step(self) -> None:
        """Counts a step; every `interval_steps` writes the records that changed."""
        if self.store is None:
            return
        self._steps += 1
        if self._steps % self.interval_steps or (self._flushing and not self._flushing.done()):
            return
        dirty = [t for t in self._tracked.values() if t.dirty]
        for tracked in dirty:
            tracked.dirty = False
        if dirty:
            self._flushing = self._spawn(self._write(dirty, self.resume_window_s))
        if time.monotonic() - self._renewed_at > self.resume_window_s / 4:
            self._renewed_at = time.monotonic()
            self._spawn(self._renew())

    async def _renew(self) -> None:
        """The running records' TTL pushed back (they are alive), the group's set pruned."""
        assert self.store is not None
        try:
            running = list(self._tracked.values())
            if running:
                await asyncio.wait_for(self._store_images(running), WRITE_TIMEOUT_S)
                await asyncio.wait_for(
                    self.store.expire([t.checkpoint for t in running], self.resume_window_s),
                    WRITE_TIMEOUT_S,
                )
            await asyncio.wait_for(self.store.prune_group(self.group), WRITE_TIMEOUT_S)
        except Exception as exc:  # next time
            logger.warning("could not renew this group's checkpoints: %s", exc)

    async def rewrite_all(self) -> None:
        """Redis restarted empty: every live record again."""
        await self._write(list(self._tracked.values()), self.resume_window_s)

    async def adopt_orphans(self) -> int:
        """At start: records of this group that a dead predecessor left running get the
        resume window; the routers that were streaming them resume them."""
        if self.store is None:
            return 0
        try:
            left = [c for c in await self.store.load_group(self.group) if c.state == RUNNING]
            for ckpt in left:
                ckpt.state = ORPHANED
            await self.store.save(left, self.resume_window_s)
        except Exception as exc:
            logger.warning("could not read the checkpoints of group %s: %s", self.group, exc)
            return 0
        if left:
            logger.warning(
                "%d requests of this group's previous scheduler await resumption", len(left)
            )
        return len(left)

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()

    def _spawn(self, coro: object) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _write(self, entries: list[_Tracked], ttl_s: float) -> None:
        if self.store is None or not entries:
            return
        started = time.perf_counter()
        now = time.time()
        checkpoints = [tracked.checkpoint for tracked in entries]
        for ckpt in checkpoints:
            ckpt.updated_at = now
        try:
            # The images first: a record in Redis never names an image that is not there
            # (unless the store had no room for it).
            await asyncio.wait_for(self._store_images(entries), WRITE_TIMEOUT_S)
            await asyncio.wait_for(self.store.save(checkpoints, ttl_s), WRITE_TIMEOUT_S)
            self.num_writes += len(checkpoints)
            self._failing = False
        except Exception as exc:  # Redis away: the next write (or rewrite_all) catches up
            self._failing = True
            logger.warning("checkpoint write of %d requests failed: %s", len(checkpoints), exc)
            for ckpt in checkpoints:
                tracked = self._tracked.get(ckpt.request_id)
                if tracked is not None:
                    tracked.dirty = True
        finally:
            self.write_time_s += time.perf_counter() - started

    async def _store_images(self, entries: list[_Tracked]) -> None:
        """The entries' images renewed for a resume window, and stored where missing (first
        write, Redis restarted, or expired after the store had no room)."""
        assert self.store is not None
        images = {digest: data for tracked in entries for digest, data in tracked.images.items()}
        if not images:
            return
        store = self.store.images
        missing = await store.renew(images, self.resume_window_s)
        if not missing:
            return
        kept = await store.put(
            {d: images[d] for d in missing}, self.resume_window_s, self.image_store_bytes
        )
        refused = missing - kept
        if refused:  # not tried again for these requests: their records stay without them
            for tracked in entries:
                for digest in refused & tracked.images.keys():
                    del tracked.images[digest]
            self.num_images_not_stored += len(refused)
            logger.warning(
                "%d images (%d bytes) do not fit in the image store (--image-store-"
                "mib): their requests cannot be resumed through another router",
                len(refused),
                sum(len(images[d]) for d in refused),
            )
