"""Where a Generate stream starts: a fresh request, or `resume_from` on a checkpoint.

A client whose stream broke off (its router died, its connection dropped) sends the same
`request_id` with `resume_from` = the output tokens of each sample it already received, to
any router. The request's checkpoint (pagemesh/runtime/checkpoints.py, written by the schedulers)
holds the request as first sent (a `SubmitRequest`, read back as a `Submission`), stop
strings included, and each sample's outputs so far. For each sample, with k = resume_from
and the checkpoint's L tokens:

- the first min(k, L) tokens prime the detokenizer and stop checker (their text is the
  client's already), so the text and stop strings after them come out as in the unbroken run;
- k < L: tokens k..L are replayed to the client, with the stored finish reason when the
  sample had finished;
- k >= L: a finished sample gets its final message again, with no tokens and no text (the
  client may have missed only that); an unfinished one skips the first k - L tokens of the
  resumed stream (still fed through the detokenizer and stop checker).

Then the request is submitted with `progress` = the checkpoint's tokens and finished flags
(plus samples a stop string ended during the replay), and the stream goes on. A checkpoint
whose samples all finished just replays and ends with the stored finish reasons. When the
request asked for logprobs, the checkpoint keeps each token's (the chosen token's and the
top alternatives, as the live stream carried them): replayed tokens come with exactly those,
and the resubmitted progress carries them on, for the next checkpoint. A record that lacks
them (written before they were kept) replays its tokens without logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagemesh.api.options.validation import resume_offsets
from pagemesh.runtime.checkpoints import Checkpoint, SampleState
from pagemesh.runtime.tokenizer import Tokenizer
from router import convert
from router.resume import Progress, SampleProgress
from router.sample_stream import SampleStream
from router.types import FinishReason, SampleOutput, Submission


@dataclass
class StreamPlan:
    submission: Submission  # the same for every attempt; each sends it with `progress`
    samples: list[SampleStream]
    progress: Progress
    # Scheduler-like messages to process before anything is submitted (checkpointed tokens).
    replay: list[SampleOutput] = field(default_factory=list)


def fresh(tokenizer: Tokenizer, submission: Submission) -> StreamPlan:
    n = max(submission.n, 1)
    samples = [_sample_stream(tokenizer, submission) for _ in range(n)]
    return StreamPlan(submission, samples, Progress.fresh(n))


def from_checkpoint(
    tokenizer: Tokenizer, ckpt: Checkpoint, resume_from: int | list[int]
) -> StreamPlan:
    """The plan for a client that has `resume_from` output tokens of each sample (one count
    for all, or one per sample: a stream can break between two samples' messages). Raises
    ValidationError for a list of the wrong length."""
    submission = convert.submission_from_checkpoint(ckpt.submit)
    n = max(submission.n, 1)
    states = (list(ckpt.samples) + [SampleState() for _ in range(n)])[:n]
    offsets = resume_offsets(resume_from, n)
    samples: list[SampleStream] = []
    replay: list[SampleOutput] = []
    for index, (state, resume_from) in enumerate(zip(states, offsets)):
        sample = _sample_stream(tokenizer, submission)
        num_known = len(state.token_ids)
        finish_reason = None
        if state.finished:
            finish_reason = convert.finish_reason_from_pb(state.finish_reason) or FinishReason.STOP
        sample.prime(
            state.token_ids[:resume_from], final=state.finished and resume_from >= num_known
        )
        if sample.stop.stopped:  # a stop string ended it within what the client has
            replay.append(SampleOutput(index, [], FinishReason.STOP))
        elif resume_from < num_known:
            replay.append(
                SampleOutput(
                    index,
                    list(state.token_ids[resume_from:]),
                    finish_reason,
                    _logprobs(state, submission)[resume_from:],
                )
            )
        elif state.finished:
            replay.append(SampleOutput(index, [], finish_reason))
        else:
            sample.num_tokens_to_skip = resume_from - num_known
        samples.append(sample)
    progress = Progress(
        [SampleProgress(list(s.token_ids), s.finished, _logprobs(s, submission)) for s in states],
        [ckpt.group],
        resumed=True,
    )
    return StreamPlan(submission, samples, progress, replay)


def _logprobs(
    state: SampleState, submission: Submission
) -> list[tuple[float, list[tuple[int, float]]]]:
    """A checkpointed sample's logprobs, one per token; empty when the request asked for
    none or the record does not have them."""
    if not submission.num_logprobs or state.logprobs is None:
        return []
    return [(logprob, list(top)) for logprob, top in state.logprobs]


def _sample_stream(tokenizer: Tokenizer, submission: Submission) -> SampleStream:
    return SampleStream(
        tokenizer, list(submission.prompt_token_ids), list(submission.stopping.stop)
    )
