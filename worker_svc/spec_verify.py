"""Speculative decoding on the sampling rank: draft tokens verified by drawing, at each
drafted position, the token decoding without drafts would have drawn there.

A request scheduled with k drafts (CachedRequestData.spec_token_ids) has k + 1 rows in the
batch's logits: the position after its last known token, then one per draft. Row j is drawn
as the (len(output) + j)-th output token with the drafts before it taken as output: its
penalties see them and its seeded draw uses that token's counter (worker_svc/sampler.py),
so it is exactly the token a step without drafts would draw there once those drafts had
been drawn. The request keeps row 0's token, then row j + 1's for as long as draft j equals
row j's token. For drafts proposed as single tokens (n-gram, suffix), this keeps the target
distribution and makes the output identical, token for token and seeded draws included, to
decoding without speculation; a rejected draft only costs its row.
"""

from __future__ import annotations

from collections.abc import Sequence

from protos.step import SampledToken, SchedulerOutput
from worker_svc.batch import RequestState
from worker_svc.sampler import SamplingRow


def check_drafts(step: SchedulerOutput, requests: dict[str, RequestState]) -> None:
    """Raises ValueError for drafts this rank cannot verify exactly."""
    if step.append_sampled_tokens and any(c.spec_token_ids for c in step.cached_requests):
        raise ValueError(
            "drafts with append_sampled_tokens (async scheduling): the driver "
            "would append only the first of the tokens it keeps"
        )
    for cached in step.cached_requests:
        if not cached.spec_token_ids:
            continue
        state = requests.get(cached.request_id)
        if state is not None and state.pooling is not None:
            raise ValueError(
                f"request {cached.request_id!r}: an embedding request has no drafts to verify"
            )


def sampling_rows(
    requests: dict[str, RequestState], request_ids: Sequence[str]
) -> list[SamplingRow]:
    """One row per logits row: a request's j-th row sees its first j drafts as output."""
    rows: list[SamplingRow] = []
    previous, j = None, 0
    for request_id in request_ids:
        j = j + 1 if request_id == previous else 0
        previous = request_id
        state = requests[request_id]
        tokens = state.token_ids + state.draft_token_ids[:j] if j else state.token_ids
        rows.append(SamplingRow(state.sampling, tokens, state.num_prompt_tokens))
    return rows


def accept_drafts(
    requests: dict[str, RequestState], request_ids: Sequence[str], tokens: Sequence[SampledToken]
) -> tuple[dict[str, SampledToken], dict[str, list[SampledToken]]]:
    """Each request's first token, and the tokens after it while its drafts held."""
    sampled: dict[str, SampledToken] = {}
    spec_sampled: dict[str, list[SampledToken]] = {}
    index = 0
    while index < len(request_ids):
        request_id = request_ids[index]
        drafts = requests[request_id].draft_token_ids
        sampled[request_id] = tokens[index]
        accepted: list[SampledToken] = []
        for j, draft in enumerate(drafts):
            if tokens[index + j].token_id != draft:
                break
            accepted.append(tokens[index + j + 1])
        if drafts:
            spec_sampled[request_id] = accepted
        index += len(drafts) + 1
    return sampled, spec_sampled
