"""Resuming a request's stream after the engine group serving it failed: pure decisions.

Sampling is deterministic given (seed, token position), and the router always sets the seed
(`Submission.fresh`). So the router only has to remember, per sample, the output token ids
it has received (`Progress`; their logprobs too when asked, which only the checkpoint needs):
re-submitting the same `Submission` with those as `progress`
to any group continues exactly as the undisturbed run would, and the caller of
`Dispatcher.stream` (router/dispatcher.py) sees one continuous stream, with no gap and no
repeated token.

Which failures are resumed (`retry_kind`):

- the peer is gone or going, resumed until `ResumeConfig.timeout_s` passes without a new
  token: UNAVAILABLE (a dead or unreachable scheduler, a dropped connection, a draining
  scheduler ending its streams), ABORTED, CANCELLED (never ours: a call the router cancels
  itself ends with `asyncio.CancelledError`, not a status), DEADLINE_EXCEEDED (the router
  sets no deadline on `Submit`, so one comes from a proxy or a peer timing out).
- maybe a dying peer, maybe a bug, resumed at most `max_suspect_retries` times in a row
  without a new token: UNKNOWN and INTERNAL (a peer killed mid-frame, a proxy resetting the
  stream, `RST_STREAM`), and a stream that ends cleanly before every sample finished. A
  deterministic bug would fail the same way everywhere; it must not keep the client waiting
  for the whole timeout.
- never: every other status. INVALID_ARGUMENT, FAILED_PRECONDITION, OUT_OF_RANGE,
  NOT_FOUND, ALREADY_EXISTS, UNIMPLEMENTED say the request itself cannot be served;
  RESOURCE_EXHAUSTED is the admission limit answering (its client backs off, not us);
  PERMISSION_DENIED and UNAUTHENTICATED are configuration; DATA_LOSS is not transient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from router.types import KVHandoff

# Retried until the resume timeout.
PEER_GONE_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    }
)
# Retried a few times in a row (None = the stream ended before every sample finished).
SUSPECT_CODES = frozenset({grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, None})


def retry_kind(code: grpc.StatusCode | None) -> str | None:
    """ "peer_gone", "suspect", or None for a failure that reaches the client as it is."""
    if code in PEER_GONE_CODES:
        return "peer_gone"
    if code in SUSPECT_CODES:
        return "suspect"
    return None


@dataclass(frozen=True)
class ResumeConfig:
    # Longest wait, seconds, from a failure to a new token: for a group to take the request
    # back (another one, or the failed group's replacement). Past it the client gets UNAVAILABLE.
    timeout_s: float = 120.0
    # Backoff between attempts when no other group is there to try at once, seconds.
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 0.5
    # Failures with a suspect status (UNKNOWN, INTERNAL, early end) retried in a row.
    max_suspect_retries: int = 2

    def __post_init__(self) -> None:
        if self.timeout_s < 0:
            raise ValueError(f"resume timeout_s must be >= 0, got {self.timeout_s}")
        if not 0 < self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError("backoffs must satisfy 0 < initial_backoff_s <= max_backoff_s")
        if self.max_suspect_retries < 0:
            raise ValueError("max_suspect_retries must be >= 0")


@dataclass
class SampleProgress:
    token_ids: list[int] = field(default_factory=list)  # output ids received, in order
    finished: bool = False  # its last message arrived (or a stop string ended it here)
    # Per token received, (chosen logprob, [(alternative id, logprob), ...]) when the request
    # asked for logprobs; a resume sends them along for the checkpoint to keep.
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    # Its KV held on the group it last ran on (a prefill group's, a draining one's): the
    # next attempt carries it, for that group to pull rather than recompute. Dropped once
    # the sample moves on.
    kv_handoff: KVHandoff | None = None


@dataclass
class Progress:
    """What each sample of one request produced so far, as the router received it.

    Invariant: `samples[i].token_ids` is exactly the output of sample i the scheduler(s)
    streamed, in order, with no gap and no repeat; it is what a resume sends as `progress`.
    """

    samples: list[SampleProgress]
    # Engine groups (registry "group") that were sent this request, first first: each may hold
    # a checkpoint entry for it in its group set.
    groups: list[str] = field(default_factory=list)
    # A resume on a new router: every attempt carries `progress`, even an empty one.
    resumed: bool = False

    @classmethod
    def fresh(cls, num_samples: int) -> Progress:
        return cls([SampleProgress() for _ in range(max(num_samples, 1))])

    @property
    def started(self) -> bool:
        """Something was produced (or it is a resume): a new attempt must carry `progress`."""
        return self.resumed or any(s.token_ids or s.finished for s in self.samples)

    @property
    def all_finished(self) -> bool:
        return all(s.finished for s in self.samples)

    @property
    def num_unfinished(self) -> int:
        return sum(not s.finished for s in self.samples)

    def num_tokens(self) -> list[int]:
        return [len(s.token_ids) for s in self.samples]

    def record(
        self,
        index: int,
        token_ids: list[int],
        finished: bool,
        logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None,
    ) -> None:
        sample = self.samples[index]
        if token_ids:
            sample.kv_handoff = None
        sample.token_ids.extend(token_ids)
        if logprobs:
            sample.logprobs.extend(logprobs)
        sample.finished = sample.finished or finished

    def finish(self, index: int) -> None:
        """The router ended this sample (a stop string): a resume must not run it again."""
        self.samples[index].finished = True

    def served_by(self, group: str) -> None:
        if group not in self.groups:
            self.groups.append(group)


class Attempts:
    """Retry state of one request: which groups just failed it, the backoff and deadline.

    A new token resets everything: the timeout counts from the first failure after the
    last token, and the failed groups become eligible again (their replacements may be up).
    """

    def __init__(self, config: ResumeConfig, clock: Callable[[], float], started: bool) -> None:
        self.config = config
        self._clock = clock
        self._started = started  # progress came with the request (a resume on a new router)
        self.num_failures = 0  # since the last new token
        self._num_suspect = 0
        self._failed: set[str] = set()
        self._deadline: float | None = None
        self._backoff_s = config.initial_backoff_s

    @property
    def excluded(self) -> frozenset[str]:
        """Groups to avoid while another one can be tried at once."""
        return frozenset(self._failed)

    @property
    def may_wait(self) -> bool:
        """Whether to wait for a group: yes once the request was accepted somewhere (it is
        owed an answer); a fresh request that finds no group fails fast instead."""
        return self._started or self.num_failures > 0

    def progressed(self) -> None:
        if self._deadline is None:  # no failure since the last progress: nothing to reset
            return
        self.num_failures = self._num_suspect = 0
        self._failed.clear()
        self._deadline = None
        self._backoff_s = self.config.initial_backoff_s

    def failed(self, scheduler_id: str, code: grpc.StatusCode | None) -> str | None:
        """Records a failed attempt; returns why to give up, or None to try again."""
        kind = retry_kind(code)
        if kind is None:
            return "the failure is not one a retry can fix"
        self.num_failures += 1
        self._failed.add(scheduler_id)
        if self._deadline is None:
            self._deadline = self._clock() + self.config.timeout_s
        if kind == "suspect":
            self._num_suspect += 1
            if self._num_suspect > self.config.max_suspect_retries:
                return f"it failed {self._num_suspect} times in a row"
        if self.remaining_s() <= 0:
            return (
                f"no engine group took it back within --resume-timeout-s {self.config.timeout_s:g}"
            )
        return None

    def remaining_s(self) -> float:
        if self._deadline is None:
            return self.config.timeout_s
        return self._deadline - self._clock()

    def next_backoff_s(self) -> float:
        """The next wait, seconds: doubling from initial_backoff_s up to max_backoff_s,
        never past the deadline."""
        backoff_s = self._backoff_s
        self._backoff_s = min(self._backoff_s * 2, self.config.max_backoff_s)
        return max(0.0, min(backoff_s, self.remaining_s()))
