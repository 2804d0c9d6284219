"""The scheduler's draft proposers for speculative decoding (the config:
pagemesh/runtime/speculative_config.py).

Drafts travel in the step message (`CachedRequestData.spec_token_ids`): no second round
trip. The workers verify them by drawing the token decoding without drafts would draw at
each drafted position (worker_svc/spec_verify.py), so the output equals decoding without
speculation token for token, seeded draws included, and only the step's cost changes.

- `ngram` (vLLM's prompt lookup, `NgramProposer`): the longest n-gram of
  `prompt_lookup_min..max` tokens ending the request's tokens that occurred before in them;
  the tokens that followed its latest occurrence are the drafts. A request's draft length
  adapts (halved after a step that kept none of its drafts, doubled back after one that
  kept all), so text with nothing to copy costs little.
- `suffix` (suffix decoding, scheduler_svc/core/suffix_decoding.py): the likeliest
  continuation by counts, over the request's own tokens and over other requests' outputs.
- `draft_model` (`WorkerDrafts`): a smaller model on the sampling rank proposes each
  request's drafts at the end of its step (worker_svc/draft.py); they come back with the
  step's tokens and go out in the next step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from pagemesh.runtime.speculative_config import SpeculativeConfig
from protos.step import ModelRunnerOutput, SampledToken, SchedulerOutput
from scheduler_svc.core.types import Request

# The longest run of decode steps a request skips drafting after its drafts kept missing.
MAX_PAUSE_STEPS = 16

if TYPE_CHECKING:
    from scheduler_svc.core.config import SchedulerConfig
    from scheduler_svc.core.suffix_decoding import SuffixProposer


class StepCosts:
    """Whether drafting pays at a batch size, from the steps' measured times: per bucket of
    decoding requests (1, 2-3, 4-7, 8-15, 16+), running averages of the tokens per ms that
    steps with drafts and steps without them gave. Drafting stays on while the drafted
    steps give at least as many (or while either is unmeasured); when they give fewer,
    only one step in EXPLORE_EVERY drafts, to keep measuring. Only steps of decodes alone
    count (a prefill chunk would weigh on either side)."""

    EXPLORE_EVERY = 8
    WEIGHT = 0.1  # of a new step in the running average

    def __init__(self) -> None:
        self._rate: dict[tuple[int, bool], float] = {}  # (bucket, drafted) -> tokens per ms
        self._steps = 0

    @staticmethod
    def bucket(num_requests: int) -> int:
        return min(num_requests, 16).bit_length()

    def pays(self, num_requests: int) -> bool:
        """Whether this step should draft (counts it as a step)."""
        self._steps += 1
        key = self.bucket(num_requests)
        drafted, plain = self._rate.get((key, True)), self._rate.get((key, False))
        if drafted is None or plain is None or drafted >= plain:
            return True
        return self._steps % self.EXPLORE_EVERY == 0

    def observe(self, num_requests: int, drafted: bool, num_tokens: int, ms: float) -> None:
        if ms <= 0 or num_requests <= 0:
            return  # unmeasured (a scripted step)
        key = (self.bucket(num_requests), drafted)
        rate = num_tokens / ms
        old = self._rate.get(key)
        self._rate[key] = rate if old is None else old + self.WEIGHT * (rate - old)


class Speculation:
    """The scheduler's side of speculative decoding: each decode's drafts (`drafts`), each
    step's verdict on them (`verified`) and the back-off it sets, a draft model's proposals
    (`offer`), and the group's totals."""

    def __init__(self, config: SchedulerConfig) -> None:
        assert config.speculative is not None
        self.proposer = make_proposer(config.speculative)
        self.max_model_len = config.max_model_len
        # Slots asked for past a decode's tokens: a draft model writes its proposals' KV there.
        self.proposal_room: int = getattr(self.proposer, "proposal_room", 0)
        self.num_drafts = 0  # a request's drafts verified in one step (vLLM's num_drafts)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # Back-off, whatever the method: after the second step in a row that kept none of a
        # request's drafts, it skips drafting for 1 step, then 2, 4, ... MAX_PAUSE_STEPS;
        # a kept draft ends it. On text with nothing to copy, drafts become rare, instead of
        # rejected rows in every step (what costs at batch 8, where rows are not free).
        self._misses: dict[str, int] = {}  # steps in a row that kept none
        self._pause: dict[str, int] = {}  # decode steps left without drafts
        # And per step: drafts only while drafted steps give more tokens per ms than plain
        # ones at this batch size (rows are not free at batch 8 in bf16 on a CPU).
        self.costs = StepCosts()
        self._drafting = True  # this step's verdict (`plan_step`)

    def plan_step(self, num_running: int) -> None:
        """Before a step is scheduled: whether its decodes draft at all."""
        self._drafting = self.costs.pays(num_running)

    def observe_step(self, output: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """A returned step's time, if it was decodes alone (each request's known token and
        its drafts), for `StepCosts`."""
        drafts = {c.request_id: len(c.spec_token_ids) for c in output.cached_requests}
        scheduled = output.num_scheduled_tokens
        if output.new_requests or any(n != 1 + drafts.get(r, -1) for r, n in scheduled.items()):
            return
        tokens = len(result.sampled) + sum(len(t) for t in result.spec_sampled.values())
        self.costs.observe(len(scheduled), any(drafts.values()), tokens, result.forward_time_ms)

    def drafts(self, request: Request, budget: int) -> list[int]:
        """Draft tokens to verify after a decode's token (none for a prefill or an embedding
        request), within the step's budget, max_tokens and max_model_len. A structured-output
        request's drafts are verified under its grammar (worker_svc/structured.py)."""
        if (
            request.num_computed_tokens + 1 != request.num_tokens
            or request.pooling is not None
            or request.num_pending_tokens
        ):
            return []
        paused = self._pause.get(request.request_id, 0)
        if not self._drafting:
            return []
        if paused:
            self._pause[request.request_id] = paused - 1
            return []
        room = min(
            self.proposer.max_drafts(request.request_id),
            budget - 1,
            request.max_tokens - len(request.output_token_ids) - 1,
            self.max_model_len - request.num_tokens - 1,
        )
        return self.proposer.propose(
            request.request_id, request.prompt_token_ids, request.output_token_ids, room
        )

    def verified(
        self, request: Request, first: SampledToken, accepted: Sequence[SampledToken]
    ) -> Sequence[SampledToken]:
        """The step's verdict on the request's drafts: its KV rolled back past the first one
        rejected, and the tokens drawn after the first (`accepted`, one per draft kept: each
        kept draft must equal the token drawn before it, whose KV it was computed with)."""
        drafts = request.spec_token_ids
        if not drafts:
            return self.nothing_drafted(request, accepted)
        drawn = [first.token_id, *(t.token_id for t in accepted[:-1])]
        if len(accepted) > len(drafts) or drawn[: len(accepted)] != drafts[: len(accepted)]:
            raise ValueError(
                f"request {request.request_id}: {len(accepted)} drafts kept of "
                f"{drafts}, but the tokens drawn were {drawn}"
            )
        request.num_computed_tokens -= len(drafts) - len(accepted)
        request.spec_token_ids = []
        request.num_draft_tokens += len(drafts)
        request.num_accepted_tokens += len(accepted)
        self.num_drafts += 1
        self.num_draft_tokens += len(drafts)
        self.num_accepted_tokens += len(accepted)
        self.proposer.observe(request.request_id, len(drafts), len(accepted))
        self._back_off(request.request_id, kept_any=bool(accepted))
        return accepted

    def _back_off(self, request_id: str, kept_any: bool) -> None:
        if kept_any:
            self._misses.pop(request_id, None)
            return
        misses = self._misses[request_id] = self._misses.get(request_id, 0) + 1
        if misses >= 2:
            self._pause[request_id] = min(1 << (misses - 2), MAX_PAUSE_STEPS)

    @staticmethod
    def nothing_drafted(
        request: Request, accepted: Sequence[SampledToken]
    ) -> Sequence[SampledToken]:
        if accepted:
            raise ValueError(f"request {request.request_id}: tokens for drafts it was not sent")
        return ()

    def offer(self, drafts: Mapping[str, list[int]]) -> None:
        """A draft model's proposals, for each request's next step."""
        if isinstance(self.proposer, WorkerDrafts):
            self.proposer.offer(drafts)

    def finished(self, request: Request) -> None:
        """The request ended: its last tokens too go to the proposer (suffix decoding keeps
        its answer), then its state goes."""
        if request.output_token_ids:
            self.proposer.propose(
                request.request_id, request.prompt_token_ids, request.output_token_ids, 0
            )
        self.proposer.forget(request.request_id)
        self._misses.pop(request.request_id, None)
        self._pause.pop(request.request_id, None)


def make_proposer(config: SpeculativeConfig) -> NgramProposer | SuffixProposer | WorkerDrafts:
    """The scheduler's proposer for the config's method."""
    if config.method == "suffix":
        from scheduler_svc.core.suffix_decoding import SuffixProposer

        return SuffixProposer(config)
    if config.method == "draft_model":
        return WorkerDrafts(config)
    return NgramProposer(config)


class WorkerDrafts:
    """`draft_model`: the drafts the draft model proposed on the sampling rank at the end of
    a request's last step (ModelRunnerOutput.draft_token_ids), handed out at its next step.
    `proposal_room` slots past a decode's tokens are asked for too, so that the draft has
    blocks to write its proposals' KV in."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.proposal_room = config.num_speculative_tokens
        self._drafts: dict[str, list[int]] = {}

    def offer(self, drafts: Mapping[str, list[int]]) -> None:
        self._drafts.update(drafts)

    def max_drafts(self, request_id: str) -> int:
        return self.config.num_speculative_tokens

    def propose(
        self, request_id: str, prompt: Sequence[int], output: Sequence[int], max_drafts: int
    ) -> list[int]:
        return self._drafts.pop(request_id, [])[: max(max_drafts, 0)]

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """The draft model proposes what it proposes: no back-off here."""

    def forget(self, request_id: str) -> None:
        self._drafts.pop(request_id, None)


class NgramProposer:
    """Prompt-lookup drafts per request, over a numpy copy of its tokens kept up to date
    incrementally (a request's tokens only grow; a shorter list starts it over)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._tokens: dict[str, np.ndarray] = {}
        self._lengths: dict[str, int] = {}
        self._budget: dict[str, int] = {}  # each request's draft length now

    def max_drafts(self, request_id: str) -> int:
        return self._budget.get(request_id, self.config.num_speculative_tokens)

    def propose(
        self, request_id: str, prompt: Sequence[int], output: Sequence[int], max_drafts: int
    ) -> list[int]:
        """Up to `max_drafts` tokens that followed the longest earlier occurrence of the
        tokens' ending n-gram; none when there is none."""
        if max_drafts <= 0:
            return []
        tokens = self._updated(request_id, prompt, output)
        n = len(tokens)
        last = tokens[n - 1]
        # Positions whose token equals the last one, extended backwards one token at a time.
        candidates = np.flatnonzero(tokens[: n - 1] == last)
        matched = 1
        lookup_min, lookup_max = self.config.prompt_lookup_min, self.config.prompt_lookup_max
        assert lookup_min is not None and lookup_max is not None  # set for the n-gram method
        while candidates.size and matched < lookup_max:
            room = candidates[candidates >= matched]  # a match cannot start before 0
            longer = room[tokens[room - matched] == tokens[n - 1 - matched]]
            if not longer.size:
                break
            candidates, matched = longer, matched + 1
        if not candidates.size or matched < lookup_min:
            return []
        start = int(candidates[-1]) + 1
        return tokens[start : start + max_drafts].tolist()

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """A step's verdict on a request's drafts: its draft length halves when none held,
        and doubles back (to num_speculative_tokens) when all did."""
        if num_drafts <= 0:
            return
        budget = self.max_drafts(request_id)
        if num_accepted == 0:
            budget = max(1, budget // 2)
        elif num_accepted == num_drafts:
            budget = min(self.config.num_speculative_tokens, budget * 2)
        self._budget[request_id] = budget

    def forget(self, request_id: str) -> None:
        for table in (self._tokens, self._lengths, self._budget):
            table.pop(request_id, None)

    def _updated(self, request_id: str, prompt: Sequence[int], output: Sequence[int]) -> np.ndarray:
        total = len(prompt) + len(output)
        buffer = self._tokens.get(request_id)
        known = self._lengths.get(request_id, 0)
        if buffer is None or known > total or known < len(prompt):
            buffer = np.empty(max(2 * total, 64), dtype=np.int64)
            buffer[: len(prompt)] = prompt
            known = len(prompt)
        if total > buffer.shape[0]:
            grown = np.empty(2 * total, dtype=np.int64)
            grown[:known] = buffer[:known]
            buffer = grown
        if total > known:
            buffer[known:total] = output[known - len(prompt) :]
        self._tokens[request_id], self._lengths[request_id] = buffer, total
        return buffer[:total]
