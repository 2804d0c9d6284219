"""Multi-LoRA in the in-process engine against PEFT on the same base folder: greedy tokens
and logprobs (fp32, 1e-4) per adapter, in one batch of several adapters and the base (more
adapters than slots, so slots are reused), the base unchanged; adapters of different ranks,
on different modules, with rsLoRA and an alpha_pattern; bad adapters refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pagemesh import LLM, LoRARequest, SamplingParams
from pagemesh.tools.testing.tiny_lora import write_lora
from pagemesh.tools.testing.tiny_models import write_realistic_model

MAX_TOKENS = 8
PROMPTS = [[5, 17, 33, 101, 7], [250, 3, 3, 89], [44] * 12, [9, 300, 12, 61, 2, 8, 8]]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_realistic_model(tmp_path_factory.mktemp("lora") / "base", "llama", seed=3)


@pytest.fixture(scope="module")
def adapters(base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "all-r8": write_lora(base, root / "all-r8", rank=8, seed=1),
        "qv-r4-rslora": write_lora(
            base,
            root / "qv-r4",
            rank=4,
            alpha=8,
            target_modules=("q_proj", "v_proj"),
            use_rslora=True,
            seed=2,
        ),
        "mlp-r16": write_lora(
            base,
            root / "mlp-r16",
            rank=16,
            alpha=32,
            seed=3,
            target_modules=("gate_proj", "up_proj", "down_proj"),
            alpha_pattern={"down_proj": 8},
        ),
    }


def reference(base: Path, adapter: Path | None, prompt: list[int]) -> tuple[list[int], list[float]]:
    """PEFT's (or the base's) greedy tokens and their logprobs, full recompute each token."""
    import peft
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    ids, tokens, logprobs = torch.tensor([prompt]), [], []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            log_probs = torch.log_softmax(model(input_ids=ids).logits[0, -1].float(), dim=-1)
            tokens.append(int(log_probs.argmax()))
            logprobs.append(float(log_probs[tokens[-1]]))
            ids = torch.cat([ids, torch.tensor([[tokens[-1]]])], dim=1)
    return tokens, logprobs


def assert_equal_peft(
    base: Path, adapters: dict[str, Path], jobs: list, outputs: list
) -> dict[tuple[tuple[int, ...], str | None], list[int]]:
    """Each output equals PEFT's greedy tokens, logprobs within 1e-4, for its (prompt,
    adapter or None); returns the tokens by (prompt, adapter)."""
    answers = {}
    for (prompt, name), output in zip(jobs, outputs, strict=True):
        tokens, logprobs = reference(base, adapters.get(name), prompt)
        sample = output.outputs[0]
        assert sample.token_ids == tokens, (name, prompt)
        np.testing.assert_allclose(
            [lp[t].logprob for lp, t in zip(sample.logprobs, tokens)], logprobs, atol=1e-4
        )
        answers[(tuple(prompt), name)] = tokens
    return answers


def test_a_batch_of_several_adapters_and_the_base_equals_peft(
    base: Path, adapters: dict[str, Path]
) -> None:
    names = list(adapters)
    requests = {
        name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())
    }
    # Every prompt with every adapter and with none: 16 requests, 3 adapters for 2 slots.
    jobs = [(prompt, name) for prompt in PROMPTS for name in [*names, None]]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    with LLM(
        str(base), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=3
    ) as engine:
        outputs = engine.generate(
            [{"prompt_token_ids": p} for p, _ in jobs],
            params,
            lora_request=[requests.get(n) for _, n in jobs],
            use_tqdm=False,
        )
    answers = assert_equal_peft(base, adapters, jobs, outputs)
    for name in names:  # each adapter changes the answer to some prompt
        assert any(answers[(tuple(p), name)] != answers[(tuple(p), None)] for p in PROMPTS), name


def test_bad_adapters_are_refused_by_name(
    base: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    other_base = write_realistic_model(
        tmp_path / "other", "llama", seed=4, hidden_size=32, intermediate_size=64
    )
    other = write_lora(other_base, tmp_path / "other-lora", rank=4)
    not_peft = tmp_path / "not-peft"
    not_peft.mkdir()
    dora = write_lora(base, tmp_path / "dora", rank=4, use_dora=True)
    params = SamplingParams(temperature=0, max_tokens=2)
    with LLM(str(base), dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8) as engine:
        cases = [
            (adapters["mlp-r16"], "rank 16, above the maximum 8"),
            (other, "do not fit the model's layer"),
            (not_peft, "no adapter_config.json"),
            (dora, "DoRA"),
        ]
        for i, (path, needle) in enumerate(cases):
            with pytest.raises(ValueError, match=needle):
                engine.generate(
                    [[5, 6]],
                    params,
                    use_tqdm=False,
                    lora_request=LoRARequest(f"bad-{i}", 90 + i, str(path)),
                )
        # Nothing was lost: the engine serves the base and a good adapter after.
        out = engine.generate(
            [[5, 6]],
            params,
            use_tqdm=False,
            lora_request=LoRARequest("ok", 1, str(adapters["all-r8"])),
        )
        assert len(out[0].outputs[0].token_ids) == 2
    with LLM(str(base), dtype="float32") as plain:
        with pytest.raises(ValueError, match="enable_lora=True"):
            plain.generate(
                [[5, 6]],
                params,
                use_tqdm=False,
                lora_request=LoRARequest("x", 1, str(adapters["all-r8"])),
            )
    assert json.loads((adapters["all-r8"] / "adapter_config.json").read_text())["r"] == 8


def test_adapters_sharded_over_two_tensor_parallel_ranks_equal_peft(
    base: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """tp=2: each adapter is sharded as its base layer (B rows of the merged q|k|v and
    gate|up, A columns of o_proj and down_proj), read and checked by every worker process
    when a call first names it: another base model's adapter is refused before any step."""
    names = ["all-r8", "mlp-r16", None]
    jobs = [(prompt, name) for prompt in PROMPTS[:2] for name in names]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    other = write_lora(
        write_realistic_model(
            tmp_path / "other", "llama", seed=4, hidden_size=32, intermediate_size=64
        ),
        tmp_path / "other-lora",
        rank=4,
    )
    with LLM(
        str(base),
        dtype="float32",
        tensor_parallel_size=2,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
    ) as engine:
        with pytest.raises(ValueError, match="do not fit the model's layer"):
            engine.generate(
                [[5, 6]],
                SamplingParams(temperature=0, max_tokens=2),
                use_tqdm=False,
                lora_request=LoRARequest("other", 99, str(other)),
            )
        outputs = engine.generate(
            [{"prompt_token_ids": p} for p, _ in jobs],
            params,
            use_tqdm=False,
            lora_request=[
                LoRARequest(n, i + 1, str(adapters[n])) if n else None
                for i, (_, n) in enumerate(jobs)
            ],
        )
    assert_equal_peft(base, adapters, jobs, outputs)
