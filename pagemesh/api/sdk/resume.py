"""Resuming a Generate stream whose router died: pure decisions, no gRPC calls, no I/O.

`StreamState` is one request's stream as the client saw it. The sync and async clients
drive it the same way: send `next_request()` to `address_index`, pass every response to
`accept()` (which returns what is new, or None), and on a failure ask `failed()` how long to
wait before the next attempt (or get the typed error to raise).

How a resume is exact (each token and character reaches the caller once):
- The router's checkpoint holds every sample's tokens; a request sent again with the same
  `request_id` and `resume_from` = k continues every sample after its first k tokens, its
  detokenizer primed with them, so the text that follows starts where the text of those k
  tokens ended in the unbroken run (router/replay.py).
- gRPC's `resume_from` is one count for every sample, but an n > 1 stream can break between
  two samples' chunks, so their counts differ. The client resumes from the largest k that
  every sample has passed *at a chunk boundary* (where it knows the text length after k
  tokens) and drops, per sample, the tokens and characters it already holds. With one token
  per chunk (the router's default) k is the smallest count, a replayed chunk aside; it is 0
  at worst, which replays every sample from its start.
- Nothing received yet: the request is sent again whole, under the same id; a router that
  has its checkpoint replays it, one that has not starts it.

Which failures are resumed mirrors router/resume.py (the router resuming on engine groups):
- the peer gone (UNAVAILABLE, ABORTED, CANCELLED, DEADLINE_EXCEEDED not of the call's own
  deadline), until `resume_timeout_s` passes without a new chunk; so is a resume that a
  router's admission limit refuses (RESOURCE_EXHAUSTED: every client of a dead router
  arriving at once), as the request is owed its answer;
- a suspect failure (UNKNOWN, INTERNAL, a stream that ended before every sample finished)
  at most `max_suspect_retries` times in a row: a deterministic bug must not keep the
  caller waiting for the whole timeout;
- anything else (INVALID_ARGUMENT, NOT_FOUND, UNAUTHENTICATED, ...) never.
A request that received nothing yet tries each router address once and then fails: no
router to take a new request is an error to report, not to wait out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from pagemesh.api.sdk import errors
from pagemesh.api.sdk.types import Chunk, TokenLogprob, Usage, finish_reason_from_pb
from protos.pagemesh.v1 import generate_pb2

PEER_GONE_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    }
)
# None: the stream ended cleanly before every sample finished.
SUSPECT_CODES = frozenset({grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, None})
EARLY_END = "the stream ended before every sample finished"


@dataclass(frozen=True)
class ResumePolicy:
    # Longest wait, seconds, from a broken stream to a new chunk (another router taking it
    # over, or the same one restarted). Past it the stream raises the last failure's error.
    resume_timeout_s: float = 60.0
    # Resumes per request; None = no bound but the timeout; 0 = never resume.
    max_resumes: int | None = None
    # Wait between attempts once every address failed since the last chunk, seconds.
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 1.0
    # Suspect failures (UNKNOWN, INTERNAL, an early end) resumed in a row.
    max_suspect_retries: int = 2

    def __post_init__(self) -> None:
        if self.resume_timeout_s < 0:
            raise ValueError(f"resume_timeout_s must be >= 0, got {self.resume_timeout_s}")
        if self.max_resumes is not None and self.max_resumes < 0:
            raise ValueError(f"max_resumes must be >= 0 or None, got {self.max_resumes}")
        if not 0 < self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError("backoffs must satisfy 0 < initial_backoff_s <= max_backoff_s")
        if self.max_suspect_retries < 0:
            raise ValueError("max_suspect_retries must be >= 0")


@dataclass
class _Sample:
    num_tokens: int = 0
    num_chars: int = 0  # characters of text received
    finished: bool = False
    # Characters received when a chunk ended after this many tokens: where a resume from
    # that count starts its text. 0 tokens -> 0 characters always.
    boundaries: dict[int, int] = field(default_factory=lambda: {0: 0})
    # Of the current attempt's stream, what this sample already has (a resume's replay).
    tokens_to_skip: int = 0
    chars_to_skip: int = 0


class StreamState:
    """One request's stream across attempts. `request` must carry its `request_id`."""

    def __init__(
        self,
        request: generate_pb2.GenerateRequest,
        policy: ResumePolicy,
        *,
        num_addresses: int,
        first_address: int = 0,
        deadline: float | None = None,
        clock: Callable[[], float],
    ) -> None:
        if not request.request_id:
            raise ValueError("a resumable stream needs its request_id set")
        self.request = request
        self.request_id = request.request_id
        self.policy = policy
        self.num_addresses = num_addresses
        self.address_index = first_address % num_addresses
        self.deadline = deadline  # clock() time the whole call must end by (its timeout)
        self._clock = clock
        self._samples = [_Sample() for _ in range(max(request.n, 1))]
        self.num_resumes = 0  # attempts after the first
        self._received = False  # any chunk, ever
        self._failures = 0  # since the last new chunk
        self._suspect = 0  # suspect failures since the last new chunk
        self._give_up_at: float | None = None  # resume deadline of the current break

    @classmethod
    def resuming(
        cls,
        request_id: str,
        resume_from: int,
        n: int,
        policy: ResumePolicy,
        *,
        num_addresses: int,
        first_address: int = 0,
        deadline: float | None = None,
        clock: Callable[[], float],
    ) -> StreamState:
        """A stream another process (or an earlier life of this one) began: every sample
        already has `resume_from` tokens, and what comes is what follows them."""
        request = generate_pb2.GenerateRequest(request_id=request_id, resume_from=resume_from, n=n)
        state = cls(
            request,
            policy,
            num_addresses=num_addresses,
            first_address=first_address,
            deadline=deadline,
            clock=clock,
        )
        for sample in state._samples:
            sample.num_tokens = resume_from
            sample.boundaries = {resume_from: 0}  # their text is not ours: count from there
        state._received = True
        return state

    @property
    def complete(self) -> bool:
        """Every sample finished: the stream has nothing more to give."""
        return all(s.finished for s in self._samples)

    def remaining_s(self) -> float | None:
        """Seconds left of the call's timeout (None = no timeout); the next attempt's."""
        return None if self.deadline is None else max(0.0, self.deadline - self._clock())

    def resume_point(self) -> int:
        """The largest token count every sample passed at a chunk boundary."""
        common = set(self._samples[0].boundaries)
        for sample in self._samples[1:]:
            common &= set(sample.boundaries)
        return max(k for k in common if k <= min(s.num_tokens for s in self._samples))

    def next_request(self) -> generate_pb2.GenerateRequest:
        """What to send now: the request itself, or a resume of it."""
        if not self._received:
            return self.request
        k = self.resume_point()
        for sample in self._samples:
            sample.tokens_to_skip = sample.num_tokens - k
            sample.chars_to_skip = sample.num_chars - sample.boundaries[k]
        if k == 0:  # replays what the checkpoint has (or starts it, when there is none)
            return self.request
        return generate_pb2.GenerateRequest(
            request_id=self.request_id, resume_from=k, model=self.request.model
        )

    def accept(self, pb: generate_pb2.GenerateResponse) -> Chunk | None:
        """What `pb` brings that the caller has not seen; None when nothing."""
        if pb.index >= len(self._samples):
            raise errors.InternalError(
                f"the router sent sample {pb.index} of a request with {len(self._samples)}",
                request_id=self.request_id,
            )
        sample = self._samples[pb.index]
        token_ids = list(pb.token_ids)
        logprobs = [TokenLogprob.from_pb(lp) for lp in pb.logprobs]
        text = pb.text
        if sample.tokens_to_skip:
            skip = min(sample.tokens_to_skip, len(token_ids))
            sample.tokens_to_skip -= skip
            token_ids, logprobs = token_ids[skip:], logprobs[skip:]
        if sample.chars_to_skip:
            skip = min(sample.chars_to_skip, len(text))
            sample.chars_to_skip -= skip
            text = text[skip:]
        finish_reason = finish_reason_from_pb(pb.finish_reason)
        if sample.finished:  # its end again, replayed: the caller has it all
            token_ids, logprobs, text, finish_reason = [], [], "", None
        usage = (
            Usage(pb.usage.prompt_tokens, pb.usage.completion_tokens)
            if pb.HasField("usage")
            else None
        )
        sample.num_tokens += len(token_ids)
        sample.num_chars += len(text)
        sample.finished = sample.finished or finish_reason is not None
        if not sample.tokens_to_skip and not sample.chars_to_skip:
            sample.boundaries[sample.num_tokens] = sample.num_chars
        if not (token_ids or text or finish_reason or usage):
            return None
        self._received = True
        self._failures = self._suspect = 0
        self._give_up_at = None
        return Chunk(self.request_id, pb.index, token_ids, text, logprobs, finish_reason, usage)

    def failed(self, code: grpc.StatusCode | None, details: str) -> float:
        """Records a failed attempt (`code` None: an early clean end). Returns the seconds
        to wait before the next attempt (on `address_index`, already moved on), or raises
        the typed error when the stream cannot be resumed."""
        now = self._clock()
        details = details or EARLY_END
        if (
            code is grpc.StatusCode.DEADLINE_EXCEEDED
            and self.deadline is not None
            and now >= self.deadline
        ):
            raise self._error(code, details)
        suspect = code in SUSPECT_CODES
        # A resume refused by a router's admission limit (every client of a dead router
        # arriving at once) is owed its answer: it waits like for a router that is down.
        busy = code is grpc.StatusCode.RESOURCE_EXHAUSTED and self._received
        if code not in PEER_GONE_CODES and not suspect and not busy:
            raise self._error(code, details)
        self._failures += 1
        self._suspect += suspect
        if self._give_up_at is None:
            self._give_up_at = now + self.policy.resume_timeout_s
        if not self._received and self._failures >= self.num_addresses:
            raise self._error(code, f"{details} (tried {self._failures} router address(es))")
        if self.policy.max_resumes is not None and self.num_resumes >= self.policy.max_resumes:
            raise self._error(code, f"{details} (max_resumes={self.policy.max_resumes} reached)")
        if self._suspect > self.policy.max_suspect_retries:
            raise self._error(code, f"{details} ({self._suspect} times in a row)")
        if now >= self._give_up_at:
            raise self._error(
                code,
                f"{details} (no router took the stream back within "
                f"resume_timeout_s={self.policy.resume_timeout_s:g})",
            )
        self.num_resumes += 1
        self.address_index = (self.address_index + 1) % self.num_addresses
        return min(self._backoff_s(), self._give_up_at - now)

    def _backoff_s(self) -> float:
        """0 while an address not tried since the last chunk is left; then doubling."""
        num_waits = self._failures - self.num_addresses
        if num_waits < 0:
            return 0.0
        return min(
            self.policy.initial_backoff_s * 2 ** min(num_waits, 30), self.policy.max_backoff_s
        )

    def _error(self, code: grpc.StatusCode | None, details: str) -> errors.PagemeshError:
        return errors.from_status(
            code or grpc.StatusCode.UNKNOWN,
            details,
            request_id=self.request_id,
            num_resumes=self.num_resumes,
        )
