"""`LLM.beam_search`: vLLM's offline beam search, with transformers' rules
(pagemesh/api/beam_search.py).

Each round sends every running beam of every prompt as one batch of one-token requests
asking for the beams' alternatives; the prefix cache shares the beams' common blocks. The
results are vLLM's `BeamSearchOutput`s: per prompt, the `beam_width` best sequences, best
first, each with the prompt's tokens and its own (as vLLM returns them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from offline.outputs import Logprob
from pagemesh.api.beam_search import Beam, BeamSearch, BeamSearchParams, check_num_candidates
from pagemesh.api.sampling_params import SamplingParams

if TYPE_CHECKING:
    from offline.llm import LLM


@dataclass
class BeamSearchSequence:
    """One beam, as vLLM returns it: `tokens` are the prompt's then the beam's, `text` their
    decoding; `logprobs` one {token id: Logprob} per generated token."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """One prompt's best `beam_width` sequences, best first."""

    sequences: list[BeamSearchSequence]


def beam_search(
    llm: LLM, prompts: Sequence[Any], params: BeamSearchParams, lora_request: Any = None
) -> list[BeamSearchOutput]:
    parsed = [llm._prompt(prompt) for prompt in prompts]
    eos = [] if params.ignore_eos else llm.limits.eos_token_ids
    searches = [
        BeamSearch(
            params.beam_width, params.max_tokens, eos, params.length_penalty, params.early_stopping
        )
        for _ in parsed
    ]
    if not searches:
        return []
    check_num_candidates(searches[0], "beam_width")
    width = searches[0].num_candidates
    for prompt in parsed:
        if len(prompt.token_ids) + params.max_tokens > llm.limits.max_model_len:
            raise ValueError(
                f"a prompt of {len(prompt.token_ids)} tokens and max_tokens "
                f"{params.max_tokens} exceed the model's context of "
                f"{llm.limits.max_model_len} tokens"
            )
    step = SamplingParams(max_tokens=1, temperature=0.0, logprobs=width, ignore_eos=True)
    while True:
        sent = [
            (search, beam, prompt)
            for search, prompt in zip(searches, parsed)
            if not search.done
            for beam in search.running
        ]
        if not sent:
            break
        outputs = llm.generate(
            [{"prompt_token_ids": prompt.token_ids + beam.token_ids} for _, beam, prompt in sent],
            step,
            use_tqdm=False,
            lora_request=[lora_request] * len(sent) if lora_request is not None else None,
        )
        alternatives: dict[int, list[list[tuple[int, float]]]] = {}
        for (search, _, _), output in zip(sent, outputs):
            (entry,) = output.outputs[0].logprobs
            ranked = sorted(entry.items(), key=lambda item: -item[1].logprob)[:width]
            alternatives.setdefault(id(search), []).append(
                [(token, logprob.logprob) for token, logprob in ranked]
            )
        for search in searches:
            if not search.done:
                search.advance(alternatives[id(search)])
    return [
        BeamSearchOutput([_sequence(llm, prompt.token_ids, beam, params) for beam in search.best()])
        for search, prompt in zip(searches, parsed)
    ]


def _sequence(
    llm: LLM, prompt_ids: list[int], beam: Beam, params: BeamSearchParams
) -> BeamSearchSequence:
    tokens = prompt_ids + beam.token_ids
    return BeamSearchSequence(
        tokens=tokens,
        logprobs=[
            {token: Logprob(logprob)} for token, logprob in zip(beam.token_ids, beam.logprobs)
        ],
        cum_logprob=beam.cumulative_logprob,
        text=llm.tokenizer.decode(tokens, skip_special_tokens=params.skip_special_tokens),
        finish_reason=beam.finish_reason,
    )
