"""A generation's checkpoint as `Generation` (router/generation.py) uses it: looked up
when a request names an id (a resume, router/replay.py, or a new request under an id that
may have one), its images read back from the image store, and deleted in the background once
the client has every token. The lookup is bounded: a store that is away makes new requests
skip theirs for a while rather than wait on it."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import TYPE_CHECKING

import grpc
from redis.exceptions import RedisError

from pagemesh.api.options.validation import ValidationError
from pagemesh.runtime.checkpoints import Checkpoint, CheckpointStore
from pagemesh.runtime.serving import ServiceError, invalid_argument, unavailable
from pagemesh.runtime.tokenizer import Tokenizer
from router import replay
from router.types import GenerationRequest, Submission

if TYPE_CHECKING:
    from router.group_directory import GroupDirectory

logger = logging.getLogger(__name__)

CHECKPOINT_LOOKUP_S = 0.5  # the longest a request waits for its checkpoint lookup
IMAGE_LOOKUP_S = 5.0  # ... and for a resumed request's images (megabytes, maybe)
STORE_AWAY_S = 2.0  # after a failed lookup, new requests skip theirs this long


class CheckpointLifetime:
    """`Generation`'s checkpoint lookups and deletes (it inherits them, and sets these in
    its __init__)."""

    tokenizer: Tokenizer
    directory: GroupDirectory
    checkpoints: CheckpointStore
    _to_delete: list[tuple[str, str | None]]  # checkpoints of ended requests
    _store_away_until: float  # loop time: until then, no lookup for a new request
    _deleter: asyncio.Task[None] | None

    async def _resume_plan(
        self, request_id: str, mesh_id: str, request: GenerationRequest, digest: str
    ) -> replay.StreamPlan | None:
        """A resume (router/replay.py) when the caller's request has a checkpoint; None for a
        new request. NOT_FOUND for `resume_from` > 0 without a checkpoint; INVALID_ARGUMENT
        when the checkpoint is of another request the caller sent under the same id."""
        resume_from = request.resume_from
        wants_resume = any(resume_from) if isinstance(resume_from, list) else resume_from > 0
        if not request.request_id or request.new_request:
            if wants_resume:
                raise invalid_argument(
                    "resume_from needs the id of the request to resume "
                    "(gRPC: request_id; HTTP: the X-Request-Id header)"
                )
            return None
        loop = asyncio.get_running_loop()
        if not wants_resume and loop.time() < self._store_away_until:
            return None  # Redis just failed a lookup: a new request does not wait on it again
        try:
            # Bounded: a fresh request must not wait on a frozen Redis (a lookup that times
            # out is "no checkpoint" for it, below).
            ckpt = await asyncio.wait_for(self.checkpoints.load(mesh_id), CHECKPOINT_LOOKUP_S)
        except (RedisError, OSError, TimeoutError) as exc:
            self._store_away_until = loop.time() + STORE_AWAY_S
            if wants_resume:
                raise unavailable(
                    f"the checkpoint store is unreachable ({exc}); retry shortly"
                ) from exc
            logger.debug("no checkpoint lookup (%s); a new request", exc)
            return None
        plan = self._plan_from_checkpoint(ckpt, resume_from) if ckpt is not None else None
        if plan is None or plan.submission.owner != request.owner:
            # None, or another key's (a forged record: ids are scoped per key): as unknown.
            if wants_resume:
                raise ServiceError(
                    grpc.StatusCode.NOT_FOUND,
                    f"request {request_id!r} has no checkpoint to resume from: it finished and "
                    "its output was delivered, or it ended long enough ago that its checkpoint "
                    "expired (or the id is wrong); send it again as a new request",
                )
            return None
        stored = plan.submission.request_digest
        if digest and stored and digest != stored:
            raise ServiceError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request id {request_id!r} is already taken by a different request of yours "
                "(its checkpoint is kept for the resume window): send a new request under a "
                "new id, or this id with the same request to resume it",
                reason="id_conflict",
            )
        logger.warning(
            "request %s resumed from its checkpoint (group %s, %s, %s output tokens "
            "per sample) after %s tokens the client has",
            mesh_id,
            ckpt.group,
            ckpt.state,
            [len(s.token_ids) for s in ckpt.samples],
            resume_from,
        )
        if plan.submission.images:
            plan.submission = await self._with_stored_images(request_id, plan.submission)
        return plan

    async def _with_stored_images(self, request_id: str, submission: Submission) -> Submission:
        """A checkpoint's submission with its images' bytes, from the image store (the
        record names them by SHA-256). NOT_FOUND when one is no longer there."""
        wanted = [image.sha256 for image in submission.images if not image.data]
        try:
            found = await asyncio.wait_for(self.checkpoints.images.get_many(wanted), IMAGE_LOOKUP_S)
        except (RedisError, OSError, TimeoutError) as exc:
            raise unavailable(f"the image store is unreachable ({exc}); retry shortly") from exc
        lost = [
            i
            for i, image in enumerate(submission.images)
            if not image.data and image.sha256 not in found
        ]
        if lost:
            raise ServiceError(
                grpc.StatusCode.NOT_FOUND,
                f"request {request_id!r} cannot be resumed: its image(s) {lost} (by order in "
                "the prompt) are no longer in the image store (expired with the checkpoint, "
                "or over the schedulers' --image-store-mib); send it again as a new request",
            )
        images = tuple(
            image if image.data else dataclasses.replace(image, data=found[image.sha256])
            for image in submission.images
        )
        return dataclasses.replace(submission, images=images)

    def _plan_from_checkpoint(
        self, ckpt: Checkpoint, resume_from: int | list[int]
    ) -> replay.StreamPlan:
        try:
            return replay.from_checkpoint(self.tokenizer, ckpt, resume_from)
        except ValidationError as exc:  # one count per sample, but not as many as samples
            raise invalid_argument(str(exc)) from exc

    def _forget_checkpoint(self, request_id: str, groups: list[str], cut_short: bool) -> None:
        """Deletes the request's checkpoint in the background, never delaying the client;
        the deletes of every request that ended meanwhile go in one round trip. When the
        router cut the scheduler call short (a stop string), the scheduler may still write
        the checkpoint once more as it notices: delete it again a TTL later."""
        entries = [(request_id, group) for group in groups or [None]]
        self._queue_deletes(entries)
        if cut_short:
            asyncio.get_running_loop().call_later(
                self.directory.ttl_s, self._queue_deletes, entries
            )

    def _queue_deletes(self, entries: list[tuple[str, str | None]]) -> None:
        self._to_delete += entries
        if self._deleter is None:
            self._deleter = asyncio.get_running_loop().create_task(self._delete_checkpoints())

    async def _delete_checkpoints(self) -> None:
        try:
            while self._to_delete:
                entries, self._to_delete = self._to_delete, []
                try:
                    await self.checkpoints.delete_many(entries)
                except Exception as exc:  # they expire by themselves; the poll logs Redis away
                    logger.debug("could not delete %d checkpoints: %s", len(entries), exc)
        finally:
            self._deleter = None
