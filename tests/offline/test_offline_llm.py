"""`pagemesh.LLM` with one rank, in this process: greedy equals transformers, sampling is a
function of the seed, and every vLLM field of the outputs means what it means in vLLM."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagemesh import LLM, CompletionOutput, RequestOutput, SamplingParams
from pagemesh.api.options.validation import (
    ModelLimits,
    SamplingOptions,
    StoppingOptions,
    ValidationError,
    validate,
)
from pagemesh.tools.testing.tiny_models import write_realistic_model
from tests.support.hf_reference import LOGPROB_BOUND_FP32, assert_greedy_match, hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# Small fixed sizes: no memory probing, and nothing set aside for swapping.
ENGINE_ARGS = {"dtype": "float32", "kv_cache_memory_gib": 0.02, "swap_space": 0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_realistic_model(tmp_path_factory.mktemp("offline") / "tiny-llama", "llama", seed=3)


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> Iterator[LLM]:
    with LLM(str(model_dir), **ENGINE_ARGS) as engine:
        yield engine


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


PROMPTS = [
    "The quick brown fox",
    "Paris is the capital of",
    "A paged key value cache",
    "What is the weather like today?",
]


def test_greedy_equals_transformers(llm: LLM, hf_model: torch.nn.Module) -> None:
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outputs] == PROMPTS
    for output in outputs:
        assert output.prompt_token_ids == llm.tokenizer.encode(output.prompt)
        ours = output.outputs[0].token_ids
        assert len(ours) == 12 and output.outputs[0].finish_reason == "length"
        assert_greedy_match(
            hf_model,
            output.prompt_token_ids,
            ours,
            hf_greedy(hf_model, output.prompt_token_ids, 12),
        )


def test_token_id_prompts_dicts_and_one_prompt(llm: LLM) -> None:
    by_text = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    ids = [o.prompt_token_ids for o in by_text]
    by_ids = llm.generate(ids, GREEDY, use_tqdm=False)
    by_dicts = llm.generate(
        [{"prompt_token_ids": ids[0]}, {"prompt": PROMPTS[1]}], GREEDY, use_tqdm=False
    )
    one = llm.generate(ids[0], GREEDY, use_tqdm=False)  # a single list of ids is one prompt
    tokens = [o.outputs[0].token_ids for o in by_text]
    assert [o.outputs[0].token_ids for o in by_ids] == tokens
    assert [o.outputs[0].token_ids for o in by_dicts] == tokens
    assert len(one) == 1 and one[0].outputs[0].token_ids == tokens[0]
    assert by_ids[0].prompt is None and by_ids[0].prompt_token_ids == ids[0]
    assert by_text[0].outputs[0].text == llm.tokenizer.decode(tokens[0])
    # Request ids count up across calls, as vLLM's do.
    assert int(by_ids[0].request_id) == int(by_text[1].request_id) + 1


def test_seeded_samples_repeat_and_n_samples_differ(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=10, ignore_eos=True)
    first = llm.generate(PROMPTS[0], params, use_tqdm=False)[0]
    # Batched with other work, the same seed draws the same tokens.
    again = llm.generate([PROMPTS[1], PROMPTS[0]], [GREEDY, params], use_tqdm=False)[1]
    samples = [c.token_ids for c in first.outputs]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert [c.token_ids for c in again.outputs] == samples
    assert len({tuple(s) for s in samples}) == 3, "n samples draw with seed, seed+1, seed+2"
    # Sample i is the request seeded seed + i (the mesh's rule).
    second = llm.generate(
        PROMPTS[0],
        SamplingParams(temperature=1.0, seed=1235, max_tokens=10, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert second.outputs[0].token_ids == samples[1]


def test_unseeded_requests_repeat_across_engines_seeded_alike(model_dir: Path, llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    with (
        LLM(str(model_dir), seed=5, **ENGINE_ARGS) as a,
        LLM(str(model_dir), seed=5, **ENGINE_ARGS) as b,
    ):
        assert (
            a.generate(PROMPTS, params, use_tqdm=False)[2].outputs[0].token_ids
            == b.generate(PROMPTS, params, use_tqdm=False)[2].outputs[0].token_ids
        )


def test_logprobs_are_vllms_shape_and_match_transformers(
    llm: LLM, hf_model: torch.nn.Module
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    output = llm.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0]
    assert len(output.logprobs) == 6
    ids = llm.tokenizer.encode(PROMPTS[1])
    with torch.inference_mode():
        logits = hf_model(torch.tensor([ids + output.token_ids])).logits[0, len(ids) - 1 : -1]
    reference = torch.log_softmax(logits.float(), dim=-1)
    for step, (token_id, entry) in enumerate(zip(output.token_ids, output.logprobs)):
        assert list(entry)[0] == token_id and len(entry) == 3  # greedy: the chosen is the top
        assert entry[token_id].rank == 1
        assert [e.rank for e in entry.values()] == [1, 2, 3]
        assert entry[token_id].decoded_token == llm.tokenizer.decode(
            [token_id], skip_special_tokens=False
        )
        for alternative, logprob in entry.items():
            assert abs(logprob.logprob - float(reference[step, alternative])) <= LOGPROB_BOUND_FP32
    assert output.cumulative_logprob == pytest.approx(
        sum(entry[t].logprob for t, entry in zip(output.token_ids, output.logprobs))
    )
    plain = llm.generate(
        PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False
    )[0]
    assert plain.outputs[0].logprobs is None and plain.outputs[0].cumulative_logprob is None
    zero = llm.generate(
        PROMPTS[1],
        SamplingParams(temperature=0.0, max_tokens=2, logprobs=0, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert [len(e) for e in zero.outputs[0].logprobs] == [1, 1]  # the chosen token's alone


def test_stop_strings_and_stop_token_ids(llm: LLM) -> None:
    free = llm.generate(
        PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    # Two characters first seen past the start of the text: the stop string.
    at = next(
        k
        for k in range(2, len(free.text) - 2)
        if free.text.find(free.text[k : k + 2]) == k and free.text[k : k + 2].isprintable()
    )
    stop = free.text[at : at + 2]
    cut = llm.generate(
        PROMPTS[3],
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )[0].outputs[0]
    assert cut.text == free.text[:at]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.token_ids == free.token_ids[: len(cut.token_ids)] and len(cut.token_ids) < 16
    kept = llm.generate(
        PROMPTS[3],
        SamplingParams(
            temperature=0.0,
            max_tokens=16,
            ignore_eos=True,
            stop=[stop],
            include_stop_str_in_output=True,
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == free.text[:at] + stop and kept.token_ids == cut.token_ids
    ids_only = llm.generate(
        PROMPTS[3],
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, detokenize=False),
        use_tqdm=False,
    )[0].outputs[0]
    assert ids_only.token_ids == free.token_ids and ids_only.text == ""
    stop_id = free.token_ids[4]
    by_id = llm.generate(
        PROMPTS[3],
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop_token_ids=[stop_id]),
        use_tqdm=False,
    )[0].outputs[0]
    assert by_id.token_ids == free.token_ids[: free.token_ids.index(stop_id) + 1]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == stop_id


def test_chat_renders_the_template(llm: LLM) -> None:
    conversation = [{"role": "user", "content": "hello there"}]
    outputs = llm.chat(
        [
            conversation,
            conversation
            + [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "and you?"}],
        ],
        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
        use_tqdm=False,
    )
    expected = llm.tokenizer.apply_chat_messages(conversation)
    assert outputs[0].prompt_token_ids == expected
    assert outputs[0].prompt.endswith("<|assistant|>\n")
    direct = llm.generate(
        [expected], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False
    )[0]
    assert outputs[0].outputs[0].token_ids == direct.outputs[0].token_ids
    one = llm.chat(
        conversation, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False
    )
    assert len(one) == 1 and one[0].outputs[0].token_ids == direct.outputs[0].token_ids
    with pytest.raises(ValueError, match=r"messages\[0\].role must be one of"):
        llm.chat([{"role": "robot", "content": "x"}], use_tqdm=False)


def test_output_types_and_defaults(llm: LLM) -> None:
    outputs = llm.generate("Rome is", use_tqdm=False)  # vLLM's default: 16 tokens
    output = outputs[0]
    assert isinstance(output, RequestOutput) and isinstance(output.outputs[0], CompletionOutput)
    assert output.finished and output.prompt_logprobs is None
    completion = output.outputs[0]
    assert len(completion.token_ids) <= 16
    assert completion.finish_reason in ("stop", "length")


def test_structured_output(llm: LLM) -> None:
    params = SamplingParams(
        temperature=0.0, max_tokens=12, structured_outputs={"choice": ["sunny", "rainy"]}
    )
    text = llm.generate(PROMPTS[3], params, use_tqdm=False)[0].outputs[0].text
    assert text in ("sunny", "rainy")


def _server_message(prompt_ids: list[int], limits: ModelLimits, **stopping: object) -> str:
    with pytest.raises(ValidationError) as caught:
        validate(prompt_ids, SamplingOptions(), StoppingOptions(**stopping), None, "", limits)
    return str(caught.value)


def test_bad_requests_raise_the_servers_message(llm: LLM) -> None:
    limits = llm.limits
    too_long = {"max_tokens": limits.max_model_len}
    with pytest.raises(ValueError) as caught:
        llm.generate([[1, 2]], SamplingParams(**too_long), use_tqdm=False)
    assert str(caught.value) == _server_message([1, 2], limits, **too_long)
    with pytest.raises(ValueError) as caught:
        llm.generate([[1, limits.vocab_size]], use_tqdm=False)
    assert str(caught.value) == _server_message([1, limits.vocab_size], limits)
    with pytest.raises(ValueError) as caught:
        llm.generate([[1]], SamplingParams(stop_token_ids=[-1]), use_tqdm=False)
    assert str(caught.value) == _server_message([1], limits, stop_token_ids=[-1])
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="sampling_params has 1 entries for 2 prompts"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)
    # A refused batch runs nothing: the engine still answers at once afterwards.
    assert llm.generate("a", GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_missing_or_unservable_model_fails_before_loading(tmp_path: Path, model_dir: Path) -> None:
    started = time.perf_counter()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    broken = tmp_path / "broken"
    broken.mkdir()
    config = json.loads((model_dir / "config.json").read_text())
    (broken / "config.json").write_text(
        json.dumps({**config, "model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"]})
    )
    with pytest.raises(ValueError, match="cannot serve"):
        LLM(str(broken))
    with pytest.raises(ValueError, match="tp_size"):  # 4 heads do not split over 3 ranks
        LLM(str(model_dir), tensor_parallel_size=3)
    with pytest.raises(ValueError, match="dtype must be one of"):
        LLM(str(model_dir), dtype="float8")
    with pytest.raises(ValueError, match="max_model_len=4096 must be in 1..512"):
        LLM(str(model_dir), max_model_len=4096, pipeline_parallel_size=2)
    assert time.perf_counter() - started < 5.0


def test_a_prompt_the_cache_cannot_hold_is_refused_and_the_rest_still_runs(model_dir: Path) -> None:
    with LLM(str(model_dir), dtype="float32", kv_cache_memory_gib=0.0002, swap_space=0) as small:
        capacity = small.num_kv_blocks * small.info.block_size  # tokens
        assert capacity < small.limits.max_model_len
        with pytest.raises(ValueError):
            small.generate(
                ["short", [1] * (capacity + 1)], SamplingParams(max_tokens=4), use_tqdm=False
            )
        assert len(small.generate("short", GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 12


def test_priority_orders_admission_under_the_priority_policy(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One request at a time (max_num_seqs=1): the lowest priority value runs first."""
    from offline.batch import BatchSink

    finished: list[str] = []
    deliver = BatchSink.deliver

    def recording(self: BatchSink, events: list) -> None:
        finished.extend(e.request_id for e in events if e.finish_reason is not None)
        deliver(self, events)

    monkeypatch.setattr(BatchSink, "deliver", recording)
    with LLM(str(model_dir), max_num_seqs=1, scheduling_policy="priority", **ENGINE_ARGS) as one:
        outputs = one.generate(PROMPTS[:3], GREEDY, priority=[2, 0, 1], use_tqdm=False)
    assert [o.prompt for o in outputs] == PROMPTS[:3]  # returned in submission order
    assert finished == ["1", "2", "0"]
