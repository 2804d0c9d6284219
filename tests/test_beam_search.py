"""pagemesh/api/beam_search.py against transformers' own beam search: driven round by round by
the same tiny model's forward pass (each beam's top alternatives from a full forward), the
sequences and their scores equal `generate(num_beams=..., length_penalty=...,
early_stopping=...)`'s, finished by EOS or by length. The EOS id is set to a token the
random model likes, so that beams do end early and compete with running ones."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagemesh.api.beam_search import BeamSearch, BeamSearchParams, num_candidates
from pagemesh.tools.testing.tiny_models import write_tiny_model

PROMPT = [5, 17, 33, 101, 7, 250, 3, 9]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    path = write_tiny_model(tmp_path_factory.mktemp("beam") / "tiny", "llama", seed=5)
    return AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()


def frequent_token(model: torch.nn.Module) -> int:
    """A token among the model's first choices after PROMPT: as EOS, it ends some beams."""
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0, -1]
    return int(torch.topk(logits, 1).indices[0])


def search_with_forward(model: torch.nn.Module, search: BeamSearch) -> BeamSearch:
    while not search.done:
        ids = torch.tensor([PROMPT + beam.token_ids for beam in search.running])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(ids).logits[:, -1].float(), dim=-1)
        top = torch.topk(logprobs, search.num_candidates)
        search.advance([list(zip(i.tolist(), v.tolist())) for v, i in zip(top.values, top.indices)])
    return search


# (width, length_penalty, early_stopping, max_tokens, whether a best beam ends with EOS)
CASES = [
    (2, 1.0, False, 12, True),
    (4, 1.0, False, 10, False),
    (3, 2.0, False, 14, False),
    (4, -1.0, False, 10, True),
    (3, 0.0, "never", 9, True),
    (3, 1.0, True, 12, True),
    (1, 1.0, False, 8, True),
]


@pytest.mark.parametrize("width,length_penalty,early_stopping,max_tokens,ends", CASES)
def test_equals_transformers_generate(
    model: torch.nn.Module,
    width: int,
    length_penalty: float,
    early_stopping: bool | str,
    max_tokens: int,
    ends: bool,
) -> None:
    eos = frequent_token(model)
    search = search_with_forward(
        model, BeamSearch(width, max_tokens, [eos], length_penalty, early_stopping)
    )
    with torch.no_grad():
        reference = model.generate(
            torch.tensor([PROMPT]),
            num_beams=width,
            num_return_sequences=width,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            do_sample=False,
            max_new_tokens=max_tokens,
            eos_token_id=eos,
            pad_token_id=0,
            return_dict_in_generate=True,
            output_scores=True,
        )
    got = search.best()
    assert len(got) == width
    # One beam is greedy decoding to transformers: no scores then.
    scores = getattr(reference, "sequences_scores", None)
    for index, (beam, sequence) in enumerate(zip(got, reference.sequences)):
        tokens = sequence[len(PROMPT) :].tolist()
        if eos in tokens:
            tokens = tokens[: tokens.index(eos) + 1]
        assert beam.token_ids == tokens
        if scores is not None:
            assert beam.score == pytest.approx(float(scores[index]), rel=1e-5)
        assert beam.finish_reason == ("stop" if tokens[-1] == eos else "length")
    assert any(beam.finish_reason == "stop" for beam in got) == ends


def test_candidates_and_bad_options() -> None:
    assert num_candidates(4, 1) == 8 and num_candidates(4, 0) == 8 and num_candidates(2, 3) == 8
    with pytest.raises(ValueError, match="does not sample"):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.7)
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="early_stopping"):
        BeamSearchParams(beam_width=2, max_tokens=4, early_stopping="sometimes")  # type: ignore[arg-type]
    search = BeamSearch(2, 1, [0])
    search.advance([[(3, -0.1), (4, -0.2), (0, -0.3), (5, -0.4)]])
    assert search.done and [b.token_ids for b in search.best()] == [[3], [4]]
    with pytest.raises(RuntimeError, match="done"):
        search.advance([[(3, -0.1)]])
