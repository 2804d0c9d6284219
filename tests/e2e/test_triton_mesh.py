"""The whole mesh on its Triton path: `--attention-backend triton` on CPU runs the kernels
under Triton's interpreter; greedy tokens still equal `transformers`. Kept small (the
interpreter is slow): a tiny model, short prompts, a chunked prefill sharing steps."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.support.hf_reference import assert_greedy_match, hf_greedy
from tests.support.mesh_harness import Mesh, greedy_request


@pytest.fixture(scope="module")
def triton_mesh(
    tiny_llama_dir: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Mesh]:
    mesh = Mesh(
        str(tiny_llama_dir),
        tmp_path_factory.mktemp("logs") / "triton.log",
        redis_url=redis_url,
        cluster="e2e-triton",
        extra_args=["--attention-backend", "triton", "--max-num-batched-tokens", "16"],
    )
    try:
        yield mesh.wait_ready()
    finally:
        mesh.stop()


def test_triton_backend_greedy_equals_transformers(triton_mesh: Mesh, tiny_llama_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    requests = [([7, 3, 99, 41], 6), (list(range(20, 45)), 5), ([250], 4)]
    with ThreadPoolExecutor(len(requests)) as pool:
        results = list(
            pool.map(lambda pn: triton_mesh.generate(greedy_request(*pn)).token_ids, requests)
        )
    for (prompt, n), ours in zip(requests, results):
        assert_greedy_match(model, prompt, ours, hf_greedy(model, prompt, n))
    assert "Triton's interpreter" in triton_mesh.log(), "the worker did not take the Triton path"
