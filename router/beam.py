"""Beam search for the OpenAI API (vLLM's `use_beam_search` extension), run by the router.

Each round the router sends every running beam to the mesh as a one-token request asking
for the beam's alternatives (pagemesh/api/beam_search.py decides, by transformers' rules, what
to keep); the engine groups share the beams' KV through their prefix caches. The beams of a
round run at once, as separate requests, so they batch in the scheduler and spread over
replicas. The answer comes at the end, the `n` best beams as the request's choices: a
streamed request gets them in one event each.

A beam search is not resumable: if this router dies, the client sends it again (its
rounds' requests are ordinary requests, each resumed by the mesh while this router lives).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

from pagemesh.api.beam_search import (
    Alternatives,
    BeamSearch,
    check_beam_options,
    check_num_candidates,
)
from pagemesh.api.options.validation import SamplingOptions, StoppingOptions
from pagemesh.runtime.serving import invalid_argument
from router.types import FinishReason, GenerationRequest, TokenChunk, Usage

# Runs one request (the router's `_generate`: the client's id, the mesh's id, the request).
RunOne = Callable[[str, str, GenerationRequest], AsyncIterator[list[TokenChunk]]]


def check_beam_request(request: GenerationRequest) -> None:
    """INVALID_ARGUMENT for what beam search does not combine with, saying what to change."""
    beam = request.beam
    assert beam is not None
    sampling, stopping = request.sampling, request.stopping
    try:
        check_beam_options(
            beam.width, stopping.max_tokens or 1, sampling.temperature, beam.early_stopping
        )  # type: ignore[arg-type]
    except ValueError as exc:
        raise invalid_argument(str(exc)) from None
    conflicts = {
        "n greater than best_of": request.n > beam.width,
        "top_p": sampling.top_p not in (None, 1.0),
        "top_k": bool(sampling.top_k),
        "min_p": bool(sampling.min_p),
        "presence_penalty": bool(sampling.presence_penalty),
        "frequency_penalty": bool(sampling.frequency_penalty),
        "repetition_penalty": sampling.repetition_penalty not in (None, 1.0),
        "stop strings": bool(stopping.stop),
        "min_tokens": bool(stopping.min_tokens),
        "logprobs": request.num_logprobs is not None,
        "structured output": request.constraint is not None,
        "images": bool(request.images),
        "resume_from": request.resume_from not in (0, [], None),
    }
    named = [name for name, present in conflicts.items() if present]
    if named:
        raise invalid_argument(
            f"use_beam_search does not combine with {', '.join(named)}: "
            "beam search keeps the most likely sequences and returns them "
            "whole; drop those fields or sample without beam search"
        )


async def beam_search(
    request: GenerationRequest,
    prompt_ids: list[int],
    eos_token_ids: list[int],
    max_tokens: int,
    run_one: RunOne,
    decode: Callable[[list[int]], str],
    client_id: str,
    mesh_id_for: Callable[[str], str],
) -> list[TokenChunk]:
    """The request's `n` best beams as its final chunks (usage on the last)."""
    beam = request.beam
    assert beam is not None
    stopping = request.stopping
    eos = [] if stopping.ignore_eos else [*eos_token_ids, *stopping.stop_token_ids]
    search = BeamSearch(beam.width, max_tokens, eos, beam.length_penalty, beam.early_stopping)  # type: ignore[arg-type]
    try:
        check_num_candidates(search, "best_of (or n)")
    except ValueError as exc:
        raise invalid_argument(str(exc)) from None
    step = GenerationRequest(
        sampling=SamplingOptions(temperature=0.0),
        stopping=StoppingOptions(max_tokens=1, ignore_eos=True),
        num_logprobs=search.num_candidates,
        model=request.model,
        new_request=True,
        owner=request.owner,
    )
    while not search.done:
        rounds: list[Awaitable[Alternatives]] = []
        for running in search.running:
            sub_id = uuid.uuid4().hex
            one = dataclasses.replace(
                step, request_id=sub_id, prompt=prompt_ids + running.token_ids
            )
            rounds.append(_alternatives(run_one(sub_id, mesh_id_for(sub_id), one)))
        search.advance(await asyncio.gather(*rounds))
    best = search.best(request.n)
    usage = Usage(len(prompt_ids), sum(len(b.token_ids) for b in best))
    return [
        TokenChunk(
            client_id,
            index,
            b.token_ids,
            decode(b.token_ids),
            [],
            FinishReason(b.finish_reason or "length"),
            usage if index == len(best) - 1 else None,
        )
        for index, b in enumerate(best)
    ]


async def _alternatives(batches: AsyncIterator[list[TokenChunk]]) -> Alternatives:
    """One beam's next tokens, best first, from its one-token request."""
    top: Alternatives = []
    async with contextlib.aclosing(batches):
        async for batch in batches:
            for chunk in batch:
                for entry in chunk.logprobs:
                    top = [(alt.token_id, alt.logprob) for alt in entry.top]
    return top
