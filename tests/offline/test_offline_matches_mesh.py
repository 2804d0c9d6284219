"""The same `SamplingParams` through `pagemesh.LLM` and through a mesh (`pagemesh up`, the
SDK's `to_generate_request`) give the same tokens and text: greedy, seeded, n > 1 seeded,
stop strings, logprobs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pagemesh import LLM, SamplingParams
from pagemesh.api.sampling_params import to_generate_request
from pagemesh.tools.testing.tiny_models import write_realistic_model
from protos.pagemesh.v1 import generate_pb2
from tests.support.mesh_harness import Mesh

# Both sides in fp32 with the same KV block size; their cache sizes differ, which must not
# change a token.
DTYPE = "float32"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_realistic_model(
        tmp_path_factory.mktemp("offline-mesh") / "tiny-llama", "llama", seed=5
    )


@pytest.fixture(scope="module")
def mesh(
    model_dir: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Mesh]:
    mesh = Mesh(
        str(model_dir),
        tmp_path_factory.mktemp("logs") / "offline-mesh.log",
        redis_url=redis_url,
        cluster="offline-vs-mesh",
        extra_args=["--dtype", DTYPE, "--num-kv-blocks", "256"],
    )
    try:
        yield mesh.wait_ready()
    finally:
        mesh.stop()


def _mesh_samples(
    mesh: Mesh, prompt: str, params: SamplingParams
) -> list[tuple[list[int], str, list[float]]]:
    """Per sample: token ids, text, chosen tokens' logprobs (empty without logprobs)."""
    samples: dict[int, tuple[list[int], list[str], list[float]]] = {}
    for chunk in mesh.stub.Generate(to_generate_request(prompt, params), timeout=120):
        ids, text, logprobs = samples.setdefault(chunk.index, ([], [], []))
        ids += chunk.token_ids
        text.append(chunk.text)
        logprobs += [lp.logprob for lp in chunk.logprobs]
        if chunk.finish_reason:
            assert chunk.finish_reason in (
                generate_pb2.FINISH_REASON_STOP,
                generate_pb2.FINISH_REASON_LENGTH,
            )
    return [(ids, "".join(text), lps) for _, (ids, text, lps) in sorted(samples.items())]


CASES = [
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.95, seed=42, max_tokens=12, ignore_eos=True),
    SamplingParams(
        n=3, temperature=1.0, top_k=40, seed=7, max_tokens=10, ignore_eos=True, logprobs=2
    ),
    SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=16, stop=["e", "a"]),
]


def test_offline_equals_mesh(mesh: Mesh, model_dir: Path) -> None:
    prompts = ["The quick brown fox", "Paris is the capital of"]
    with LLM(str(model_dir), dtype=DTYPE, kv_cache_memory_gib=0.02, swap_space=0) as llm:
        for params in CASES:
            offline = llm.generate(prompts, params, use_tqdm=False)
            for prompt, output in zip(prompts, offline):
                ours = [
                    (
                        c.token_ids,
                        c.text,
                        [e[t].logprob for t, e in zip(c.token_ids, c.logprobs or [])],
                    )
                    for c in output.outputs
                ]
                theirs = _mesh_samples(mesh, prompt, params)
                assert [(ids, text) for ids, text, _ in ours] == [
                    (ids, text) for ids, text, _ in theirs
                ], params
                for (_, _, a), (_, _, b) in zip(ours, theirs):
                    assert a == pytest.approx(b, abs=1e-5)
                if params.stop:  # the case stops early, in both
                    assert any(len(ids) < params.max_tokens for ids, _, _ in ours)
