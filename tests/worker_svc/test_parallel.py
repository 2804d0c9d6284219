"""Tensor and pipeline parallelism: spawned gloo engine groups against transformers and tp=1.

Each group (tp=2, pp=2, tp=2 x pp=2) is spawned once and reused: every case loads a
model into the same processes and replays the scripted continuous-batching schedule of
`test_runner_vs_hf.py` (chunked prefills, requests joining at different steps). The
tiny models hit the edge cases: a vocabulary not divisible by tp (509), fewer KV heads
than TP ranks, tied embeddings (the last stage reads embedding rows for its LM head),
3 layers split unevenly, Qwen2 biases and Qwen3 q/k norms, and mixture-of-experts blocks
(Qwen2-MoE's shared expert and dense layer, Mixtral's experts over two stages).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from pagemesh.tools.testing.tiny_models import write_tiny_model
from protos.step import NewRequestData, SamplingParams, SchedulerOutput
from tests.support import runner_script
from tests.support.hf_reference import assert_greedy_close, hf_greedy_with_logits
from tests.support.parallel_harness import LocalWorkerGroup
from tests.support.runner_script import (
    BLOCK_SIZE,
    ScriptedRequest,
    drive,
    random_prompt,
    scripted_requests,
)
from worker_svc.loader import load_model, rank_weight_shapes
from worker_svc.model.config import ModelConfig
from worker_svc.model.llama import LlamaForCausalLM
from worker_svc.parallel import ParallelConfig
from worker_svc.runner import ModelRunner
from worker_svc.runner_config import RunnerConfig

NUM_NEW_TOKENS = 10
NUM_BLOCKS = 48
GREEDY = SamplingParams(temperature=0.0)

MODELS = {
    # vocab 509 = 2 x 254 + 1: the last rank's vocab shard has a padding row;
    # one KV head: both TP ranks hold it (replicated), each with its own q heads.
    "llama_kv1_vocab509": dict(arch="llama", vocab_size=509, num_key_value_heads=1),
    "llama_tied_vocab509": dict(arch="llama", vocab_size=509, tie_word_embeddings=True),
    "qwen2": dict(arch="qwen2"),  # q/k/v biases, sharded with their rows
    "qwen3": dict(arch="qwen3"),  # per-head q/k norms, replicated
    # Mixture of experts: each rank a slice of every expert (and of the shared expert), the
    # router replicated, one all-reduce per block; layer 1 of qwen2_moe is dense.
    "qwen2_moe": dict(arch="qwen2_moe"),
    "mixtral": dict(arch="mixtral"),
    # 7 experts top-3: under expert parallelism rank 0 holds experts 0-3, rank 1 4-6.
    "qwen3_moe_7_experts": dict(arch="qwen3_moe", num_experts=7, num_experts_per_tok=3),
}
EXPERT_PARALLEL = "+ep"  # a case's model name with this suffix: --enable-expert-parallel

# (group, model, pp_layer_split); the models have 3 layers.
CASES = [
    ("tp2", "llama_kv1_vocab509", None),
    ("tp2", "llama_tied_vocab509", None),
    ("tp2", "qwen2", None),
    ("tp2", "qwen3", None),
    ("pp2", "llama_kv1_vocab509", None),  # even split of 3: (2, 1)
    ("pp2", "llama_tied_vocab509", (1, 2)),
    ("tp2pp2", "llama_kv1_vocab509", (1, 2)),
    ("tp2pp2", "llama_tied_vocab509", None),
    ("tp2", "qwen2_moe", None),
    ("tp2pp2", "mixtral", (2, 1)),
    ("tp2", "qwen2_moe+ep", None),  # whole experts per rank, all-to-all, the shared expert TP
    ("tp2", "qwen3_moe_7_experts+ep", None),
    ("tp2pp2", "mixtral+ep", (1, 2)),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    paths: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in paths:
            paths[name] = write_tiny_model(tmp_path_factory.mktemp(name), **MODELS[name])
        return paths[name]

    return get


def runner_config(path: Path, **overrides) -> RunnerConfig:
    settings = dict(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS) | overrides
    return RunnerConfig(model_path=str(path), **settings)


@pytest.fixture(scope="module")
def reference(model_dir):
    """Per model: the tp=1 runner's tokens for the scripted requests, and HF's."""
    cache: dict[str, tuple[list[ScriptedRequest], list[tuple[list[int], torch.Tensor]]]] = {}

    def get(name: str):
        if name not in cache:
            from transformers import AutoModelForCausalLM

            path = model_dir(name)
            requests = scripted_requests(MODELS[name].get("vocab_size", 512))
            drive(ModelRunner.from_config(runner_config(path)), requests, NUM_NEW_TOKENS)
            hf_model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
            cache[name] = (
                requests,
                [hf_greedy_with_logits(hf_model, r.prompt, NUM_NEW_TOKENS) for r in requests],
            )
        return cache[name]

    return get


def _group(tp_size: int, pp_size: int):
    group = LocalWorkerGroup(tp_size, pp_size)
    yield group
    group.close()


@pytest.fixture(scope="module")
def tp2():
    yield from _group(2, 1)


@pytest.fixture(scope="module")
def pp2():
    yield from _group(1, 2)


@pytest.fixture(scope="module")
def tp2pp2():
    yield from _group(2, 2)


@pytest.mark.parametrize(("group_name", "model", "layer_split"), CASES)
def test_group_matches_transformers_and_tp1(
    request, group_name, model, layer_split, model_dir, reference
) -> None:
    group: LocalWorkerGroup = request.getfixturevalue(group_name)
    model, expert_parallel = model.removesuffix(EXPERT_PARALLEL), model.endswith(EXPERT_PARALLEL)
    infos = group.load(
        runner_config(model_dir(model), parallel=ParallelConfig(expert_parallel=expert_parallel)),
        layer_split,
    )
    assert [(i.tp_rank, i.tp_size, i.pp_rank, i.pp_size) for i in infos] == [
        (r % group.tp_size, group.tp_size, r // group.tp_size, group.pp_size)
        for r in range(group.world_size)
    ]
    tp1_requests, hf_results = reference(model)
    requests = scripted_requests(infos[0].vocab_size)
    drive(group, requests, NUM_NEW_TOKENS)
    for ours, tp1, (hf_tokens, hf_logits) in zip(requests, tp1_requests, hf_results):
        assert ours.outputs == tp1.outputs, f"request {ours.request_id}"
        assert_greedy_close(ours.outputs, hf_tokens, hf_logits)


def test_seeded_sampling_is_the_same_under_tp2(tp2, model_dir, reference, monkeypatch) -> None:
    """The sampler sees the gathered logits of the whole vocabulary (padding dropped), so a
    seed draws the same tokens as on one rank."""
    greedy_requests, _ = reference("llama_kv1_vocab509")  # before sampling is switched on
    monkeypatch.setattr(
        runner_script, "GREEDY", SamplingParams(temperature=1.0, top_k=50, seed=1234)
    )
    path = model_dir("llama_kv1_vocab509")
    single = scripted_requests(509)
    drive(ModelRunner.from_config(runner_config(path)), single, NUM_NEW_TOKENS)
    tp2.load(runner_config(path))
    grouped = scripted_requests(509)
    drive(tp2, grouped, NUM_NEW_TOKENS)
    assert [r.outputs for r in grouped] == [r.outputs for r in single]
    assert [r.outputs for r in single] != [r.outputs for r in greedy_requests]  # it sampled


def test_kv_cache_budget_is_per_rank(tp2pp2, model_dir) -> None:
    """Each rank's blocks hold only its layers and KV heads, so the same budget buys more
    blocks on a rank holding less; the scheduler uses the minimum."""
    budget_bytes = 1 << 20
    infos = tp2pp2.load(
        runner_config(model_dir("qwen2"), num_blocks=None, kv_cache_memory_bytes=budget_bytes),
        (1, 2),
    )
    head_dim, element_bytes = 16, 4  # hidden 64 / 4 heads; float32
    for info in infos:
        num_local_layers = 1 if info.pp_rank == 0 else 2
        num_local_kv_heads = 1  # 2 KV heads over 2 TP ranks
        block_bytes = (
            num_local_layers * 2 * BLOCK_SIZE * num_local_kv_heads * head_dim * element_bytes
        )
        assert info.num_blocks == budget_bytes // block_bytes
    shapes = tp2pp2.call_ok("shapes")
    assert "model.layers.0.mlp.down_proj.weight" in shapes[1]
    assert "model.layers.0.mlp.down_proj.weight" not in shapes[2]


def _one_request_step(
    step_id: int, request_id: str, prompt: list[int], num_tokens: int | None = None
) -> SchedulerOutput:
    num_tokens = num_tokens or len(prompt)
    num_blocks = -(-len(prompt) // BLOCK_SIZE)
    block_ids = list(range(step_id * 8, step_id * 8 + num_blocks))
    new = NewRequestData(request_id, prompt, len(prompt), block_ids, 0, GREEDY)
    return SchedulerOutput(step_id, [new], num_scheduled_tokens={request_id: num_tokens})


def test_tp_step_mismatch_raises_on_every_rank(tp2, model_dir) -> None:
    tp2.load(runner_config(model_dir("qwen2")))
    prompt = random_prompt(6, 512, 11)
    good = _one_request_step(0, "a", prompt)
    other = _one_request_step(0, "a", prompt, num_tokens=5)
    answers = tp2.call("step", [good, other])
    assert [a.error_type for a in answers] == ["StepMismatchError"] * 2
    assert "rank 0" in answers[0].message and "rank 1" in answers[0].message
    # Nothing was applied: the same step, now agreed, runs.
    (output, _) = tp2.call_ok("step", good)
    assert set(output.sampled) == {"a"}


def test_pp_step_mismatch_raises_downstream_without_hanging(tp2pp2, model_dir) -> None:
    tp2pp2.load(runner_config(model_dir("llama_kv1_vocab509")))
    prompt = random_prompt(7, 509, 12)
    good = _one_request_step(0, "a", prompt)
    other = _one_request_step(0, "a", prompt, num_tokens=4)
    # Stage 1 got another step than stage 0: stage 1 raises, stage 0 completes.
    answers = tp2pp2.call("step", [good, good, other, other])
    assert [a.error_type for a in answers] == [None, None, "StepMismatchError", "StepMismatchError"]
    assert "stage 0" in answers[2].message and "stage 1" in answers[2].message
    # One TP rank of stage 0 differs: stage 0 raises, stage 1 learns it from stage 0.
    answers = tp2pp2.call("step", [good, other, good, good])
    assert [a.error_type for a in answers] == ["StepMismatchError"] * 2 + ["UpstreamStageError"] * 2
    # An invalid step (ValueError everywhere on stage 0) must not hang stage 1 either.
    bad = dataclasses.replace(good, step_id=1, num_scheduled_tokens={"zzz": 1})
    answers = tp2pp2.call("step", [bad] * 4)
    assert [a.error_type for a in answers] == ["ValueError"] * 4


def test_stage0_runs_ahead_of_stage1(pp2, model_dir, reference) -> None:
    """Steps are queued on every rank at once: stage 0 moves on to the next step while
    stage 1 still runs the previous one; tokens are unaffected."""
    pp2.load(runner_config(model_dir("llama_kv1_vocab509")))
    tp1_requests, _ = reference("llama_kv1_vocab509")
    steps = [_one_request_step(i, r.request_id, r.prompt) for i, r in enumerate(tp1_requests[:3])]
    for step in steps:
        pp2.send("step", step)
    for step, expected in zip(steps, tp1_requests):
        answers = pp2.collect()
        assert all(a.ok for a in answers), [a.message for a in answers]
        token = answers[pp2.driver_rank].value.sampled[expected.request_id].token_id
        assert token == expected.outputs[0]
    # A step with nothing to compute still passes through every stage, in order.
    finish = SchedulerOutput(
        len(steps), finished_request_ids=[s.new_requests[0].request_id for s in steps]
    )
    outputs = pp2.call_ok("step", finish)
    assert all(not o.sampled for o in outputs)
    step = _one_request_step(len(steps) + 1, "again", tp1_requests[0].prompt)
    assert pp2.execute_step(step).sampled["again"].token_id == tp1_requests[0].outputs[0]


# --- loading: each rank reads only its slice -----------------------------------------


def test_rank_weight_shapes(model_dir) -> None:
    path = model_dir("llama_kv1_vocab509")  # hidden 64, 4 heads of 16, 1 KV head, mlp 128
    tp_rank1 = rank_weight_shapes(path, ParallelConfig(tp_size=2, tp_rank=1))
    assert tp_rank1["model.embed_tokens.weight"] == (255, 64)  # ceil(509 / 2)
    assert tp_rank1["lm_head.weight"] == (255, 64)
    assert tp_rank1["model.layers.2.self_attn.qkv_proj.weight"] == (32 + 16 + 16, 64)
    assert tp_rank1["model.layers.2.self_attn.o_proj.weight"] == (64, 32)
    assert tp_rank1["model.layers.2.mlp.gate_up_proj.weight"] == (128, 64)
    assert tp_rank1["model.layers.2.mlp.down_proj.weight"] == (64, 64)
    assert tp_rank1["model.norm.weight"] == (64,)
    stage0 = rank_weight_shapes(path, ParallelConfig(pp_size=2, pp_rank=0, pp_layer_split=(1, 2)))
    assert {n.split(".")[2] for n in stage0 if ".layers." in n} == {"0"}
    assert "model.embed_tokens.weight" in stage0 and "lm_head.weight" not in stage0
    assert "model.norm.weight" not in stage0
    tied_last = rank_weight_shapes(
        model_dir("llama_tied_vocab509"), ParallelConfig(tp_size=2, tp_rank=0, pp_size=2, pp_rank=1)
    )
    assert {n.split(".")[2] for n in tied_last if ".layers." in n} == {"2"}
    assert "model.embed_tokens.weight" not in tied_last
    assert tied_last["lm_head.weight"] == (255, 64)  # from the embedding's rows


def test_each_rank_reads_only_its_slices(model_dir, monkeypatch) -> None:
    """Every tensor is read through get_slice with this rank's index (never get_tensor,
    never another stage's layer), and the slices land where transformers has them."""
    import safetensors

    path = model_dir("llama_kv1_vocab509")
    reads: dict[str, tuple[int, ...]] = {}
    real_safe_open = safetensors.safe_open

    class Spy:
        def __init__(self, *args, **kwargs) -> None:
            self.inner = real_safe_open(*args, **kwargs)

        def __enter__(self):
            self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, name):
            raise AssertionError(f"{name} read whole")

        def get_slice(self, name):
            inner_slice = self.inner.get_slice(name)

            class SliceSpy:
                def __getitem__(self, index):
                    tensor = inner_slice[index]
                    reads[name] = tuple(tensor.shape)
                    return tensor

            return SliceSpy()

    monkeypatch.setattr(safetensors, "safe_open", Spy)
    parallel = ParallelConfig(tp_size=2, tp_rank=1, pp_size=2, pp_rank=1)  # layers 2
    model, _ = load_model(path, parallel=parallel)
    assert not [n for n in reads if ".layers.0." in n or ".layers.1." in n]
    assert "model.embed_tokens.weight" not in reads  # untied: stage 0's only
    assert reads["lm_head.weight"] == (254, 64)  # rows 255..508; the pad row is not read
    assert reads["model.layers.2.self_attn.q_proj.weight"] == (32, 64)
    assert reads["model.layers.2.self_attn.k_proj.weight"] == (16, 64)  # the one KV head
    assert reads["model.layers.2.self_attn.o_proj.weight"] == (64, 32)
    assert reads["model.layers.2.mlp.up_proj.weight"] == (64, 64)
    assert reads["model.layers.2.mlp.down_proj.weight"] == (64, 64)

    monkeypatch.setattr(safetensors, "safe_open", real_safe_open)
    full, _ = load_model(path)
    layer = "model.layers.2."
    qkv = model.get_parameter(layer + "self_attn.qkv_proj.weight")
    full_qkv = full.get_parameter(layer + "self_attn.qkv_proj.weight")
    torch.testing.assert_close(qkv[:32], full_qkv[32:64], rtol=0, atol=0)  # q heads 2, 3
    torch.testing.assert_close(qkv[32:], full_qkv[64:], rtol=0, atol=0)  # k, v head 0
    torch.testing.assert_close(
        model.get_parameter(layer + "mlp.down_proj.weight"),
        full.get_parameter(layer + "mlp.down_proj.weight")[:, 64:],
        rtol=0,
        atol=0,
    )
    head = model.lm_head.weight
    torch.testing.assert_close(head[:254], full.lm_head.weight[255:], rtol=0, atol=0)
    assert not head[254:].any()  # the padding row


def test_gguf_shard_equals_safetensors_shard(model_dir, tmp_path) -> None:
    from tests.worker_svc.test_loader import write_tiny_gguf

    hf_path = model_dir("llama_kv1_vocab509")
    gguf_path = write_tiny_gguf(hf_path, tmp_path / "tiny.gguf")
    parallel = ParallelConfig(tp_size=2, tp_rank=1, pp_size=2, pp_rank=0)
    from_hf, _ = load_model(hf_path, parallel=parallel)
    from_gguf, _ = load_model(gguf_path, parallel=parallel)
    hf_params = dict(from_hf.named_parameters())
    gguf_params = dict(from_gguf.named_parameters())
    assert hf_params.keys() == gguf_params.keys()
    for name, param in hf_params.items():
        torch.testing.assert_close(gguf_params[name], param, msg=name)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "intermediate_size", "tp_size", "message"),
    [
        (4, 2, 128, 3, r"num_attention_heads \(4\) must be divisible by tp_size \(3\)"),
        (12, 6, 128, 4, r"num_key_value_heads \(6\) must be divisible by tp_size \(4\)"),
        (
            12,
            4,
            128,
            6,
            r"tp_size \(6\) exceeds num_key_value_heads \(4\), so it must be a multiple",
        ),
        (8, 8, 100, 8, r"intermediate_size \(100\) must be divisible by tp_size \(8\)"),
    ],
)
def test_unsplittable_shapes_are_rejected(
    num_heads, num_kv_heads, intermediate_size, tp_size, message
) -> None:
    config = ModelConfig(
        model_type="llama",
        vocab_size=100,
        hidden_size=8 * num_heads,
        intermediate_size=intermediate_size,
        num_layers=1,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=8,
        rms_norm_eps=1e-6,
        max_position_embeddings=64,
    )
    with pytest.raises(ValueError, match=message), torch.device("meta"):
        LlamaForCausalLM(config, parallel=ParallelConfig(tp_size=tp_size))


def test_runner_needs_a_process_group_for_several_ranks(model_dir) -> None:
    config = runner_config(model_dir("qwen2"), parallel=ParallelConfig(tp_size=2))
    with pytest.raises(ValueError, match="pass this rank's DistributedContext"):
        ModelRunner.from_config(config)


def test_expert_rebalancing_moves_experts_and_changes_no_token(tp2, model_dir, reference):
    """--eplb-interval-steps 3 under tp2 + ep: every third step the ranks sum their experts'
    loads and move experts so each rank's share evens out (read from the checkpoint);
    the tokens stay tp1's and transformers'."""
    name = "qwen3_moe_7_experts"
    group: LocalWorkerGroup = tp2
    group.load(
        runner_config(
            model_dir(name), parallel=ParallelConfig(expert_parallel=True), eplb_interval_steps=3
        )
    )
    before = group.call_ok("placements")
    assert before[0][0] == [0, 1, 2, 3] and before[1][0] == [4, 5, 6]  # contiguous
    tp1_requests, hf_results = reference(name)
    requests = scripted_requests(group.infos[0].vocab_size)
    drive(group, requests, NUM_NEW_TOKENS)
    for ours, tp1, (hf_tokens, hf_logits) in zip(requests, tp1_requests, hf_results):
        assert ours.outputs == tp1.outputs, f"request {ours.request_id}"
        assert_greedy_close(ours.outputs, hf_tokens, hf_logits)
    after = group.call_ok("placements")
    assert after != before  # the peaky router's load is uneven: something moved
    for layer in after[0]:  # still a partition of the experts, 4 + 3
        assert sorted(after[0][layer] + after[1][layer]) == list(range(7))
        assert (len(after[0][layer]), len(after[1][layer])) == (4, 3)
