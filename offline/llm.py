"""`pagemesh.LLM`: vLLM's offline API on pagemesh's engine core, in this process.

    from pagemesh import LLM, SamplingParams

    llm = LLM("path/to/model")  # a Hugging Face folder or a .gguf file
    for output in llm.generate(["The capital of France is"], SamplingParams(max_tokens=8)):
        print(output.outputs[0].text)

A vLLM script runs with only its import changed: the names, defaults and shapes are vLLM's
(`generate`, `chat`, `RequestOutput`, `CompletionOutput`, `SamplingParams`).

With `tensor_parallel_size = pipeline_parallel_size = 1` the engine core runs in this
process: the scheduler service's engine loop (offline/engine.py) over a model
runner on a model thread; no Redis, no gRPC, no port. Larger groups start one worker
process per rank on this machine (offline/local_workers.py), torn down by
`close()`, by leaving a `with` block, or at interpreter exit. Requests are validated,
seeded, detokenized and stopped by the router's own code (offline/batch.py), so
the same model, prompt and parameters give the same tokens as the mesh (greedy, or with a
seed) and the same errors.

`LLM` reads its inputs with offline/llm_inputs.py and answers the admin's diagnostics with
offline/llm_diagnostics.py (it inherits both).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence
from typing import Any

from offline.batch import BatchSink, Prompt, prepare
from offline.beam import BeamSearchOutput, beam_search
from offline.embed import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    EmbedSink,
    PoolingOutput,
    PoolingParams,
    PoolingRequestOutput,
    embedding_requests,
    image_input,
)
from offline.engine import EngineCore
from offline.llm_diagnostics import Diagnostics
from offline.llm_inputs import (
    IGNORED_VLLM_ARGS,
    ChatMessages,
    PromptInput,
    PromptReading,
    as_list,
    check_unused,
    params_per_prompt,
)
from offline.lora import AdapterChecks, LoRARequest, per_prompt
from offline.outputs import RequestOutput
from offline.setup import EngineSetup, build_engine, check_servable
from pagemesh.api.beam_search import BeamSearchParams
from pagemesh.api.sampling_params import SamplingParams
from pagemesh.runtime.speculative_config import SpeculativeConfig
from router.openai_protocol import chat_messages
from worker_svc.lora import LoraConfig

logger = logging.getLogger(__name__)

GIB = 1 << 30
WAIT_SLICE_S = 0.2  # how often a waiting generate() wakes (so Ctrl-C is noticed)


class LLM(PromptReading, Diagnostics):
    """An engine for offline batched generation (vLLM's `LLM`).

    - model: a Hugging Face folder (config.json, *.safetensors, tokenizer) or a .gguf
      file; None = the default SmolLM2-135M-Instruct GGUF.
    - tensor_parallel_size, pipeline_parallel_size: ranks per stage and stages; more than
      one rank starts worker processes on this machine (one GPU each on CUDA).
    - enable_expert_parallel: mixture-of-experts models, with tensor_parallel_size > 1:
      each rank holds whole experts instead of a slice of every one (vLLM's argument).
    - dtype: "auto" | "float32" | "bfloat16" | "float16" (auto: bf16 on GPUs, on CPU what
      this CPU computes fastest).
    - max_model_len: cap on prompt + output tokens (default: the model's).
    - kv_cache_memory_gib: KV cache per rank, GiB (default: sized from the device, as
      `pagemesh up` does: gpu_memory_utilization on CUDA, a share of free memory on CPU);
      or kv_cache_memory_bytes, vLLM's name, in bytes.
    - swap_space: CPU memory per rank, GiB, for the KV of requests preempted by swapping
      (vLLM's default, 4); 0 = preempted requests are recomputed.
    - enable_prefix_caching: reuse the KV of prompt blocks computed before.
    - seed: seeds the draws of requests whose SamplingParams have no seed, so a script
      gives the same outputs run after run (default 0); None = fresh randomness.
    - gpu_memory_utilization: CUDA, share of the device's memory for weights, activations
      and KV cache.
    - max_num_seqs, max_num_batched_tokens: requests, and tokens, per step.
    - block_size: tokens per KV cache block.
    - scheduling_policy: "fcfs" (arrival order) or "priority" (`generate(priority=...)`,
      lower first), as `pagemesh up --scheduling-policy`.
    - device: "auto" (CUDA when available) | "cpu" | "cuda".

    Raises FileNotFoundError for a missing model and ValueError for a model or layout it
    cannot serve, before any weight is loaded or memory is set aside.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        tokenizer: str | None = None,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        enable_expert_parallel: bool = False,
        dtype: str = "auto",
        max_model_len: int | None = None,
        kv_cache_memory_gib: float | None = None,
        kv_cache_memory_bytes: int | None = None,
        swap_space: float = 4.0,
        enable_prefix_caching: bool = True,
        seed: int | None = 0,
        gpu_memory_utilization: float = 0.9,
        max_num_seqs: int = 128,
        max_num_batched_tokens: int = 2048,
        block_size: int = 16,
        scheduling_policy: str = "fcfs",
        device: str = "auto",
        task: str = "auto",
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        max_cpu_loras: int | None = None,
        speculative_config: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        unknown = sorted(set(kwargs) - IGNORED_VLLM_ARGS)
        if unknown:
            raise TypeError(f"LLM() got unexpected keyword argument(s) {unknown}")
        if kv_cache_memory_bytes is not None:  # vLLM's name for the same budget
            if kv_cache_memory_gib is not None:
                raise ValueError("give kv_cache_memory_gib or kv_cache_memory_bytes, not both")
            kv_cache_memory_gib = kv_cache_memory_bytes / GIB
        self._engine: EngineCore | None = None
        self._workers: Any = None
        setup = EngineSetup(
            model=model,
            tokenizer=tokenizer,
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            enable_expert_parallel=enable_expert_parallel,
            dtype=dtype,
            max_model_len=max_model_len,
            kv_cache_memory_gib=kv_cache_memory_gib,
            swap_space_gib=swap_space,
            enable_prefix_caching=enable_prefix_caching,
            gpu_memory_utilization=gpu_memory_utilization,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size,
            scheduling_policy=scheduling_policy,
            device=device,
            task=task,
            lora=(
                LoraConfig(max_loras, max_lora_rank, max_cpu_loras or 0) if enable_lora else None
            ),
            speculative=SpeculativeConfig.parse(speculative_config),
        )
        checked = check_servable(setup)  # before anything is loaded or allocated
        built = build_engine(setup, checked)
        self.model_path = checked.model_path
        self.tokenizer = built.tokenizer
        self.info = built.info  # the driver rank's RunnerInfo
        self.limits = built.limits
        self.num_kv_blocks = built.num_kv_blocks
        self._grammars = built.grammars
        self._workers = built.workers
        self._check_adapters = AdapterChecks(built.load_lora)
        self._engine = built.engine
        self._ranks = built.ranks
        self._num_swap_blocks = built.num_swap_blocks
        self._seeds: random.Random = random.SystemRandom() if seed is None else random.Random(seed)
        self._next_request_id = 0

    # ------------------------------------------------------------------ vLLM's API

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
        prompt_token_ids: list[int] | list[list[int]] | None = None,
        priority: list[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        **kwargs: Any,
    ) -> list[RequestOutput]:
        """Generates for every prompt and returns one RequestOutput each, in order.

        `prompts`: a string, a list of token ids, a `{"prompt": str}` or
        `{"prompt_token_ids": [...]}` dict, or a list of these. `sampling_params`: one for
        every prompt, or one per prompt (default `SamplingParams()`: 16 tokens at
        temperature 1). `priority`: per prompt, lower runs first and is preempted last under
        `scheduling_policy="priority"` (ignored under fcfs, as in vLLM). Raises ValueError,
        before anything runs, for a prompt or parameters the servers would refuse (their
        message; a note names the prompt). `lora_request`: the LoRA adapter of every prompt,
        or one per prompt (None: the base model), with `enable_lora=True`."""
        check_unused(kwargs, "generate")
        if prompts is None:
            prompts = prompt_token_ids  # vLLM's older keyword
        parsed = [self._prompt(p) for p in as_list(prompts)]
        adapters = per_prompt(lora_request, len(parsed))
        self._check_adapters(adapters)
        for prompt, adapter in zip(parsed, adapters):
            prompt.lora = adapter
        return self._run(parsed, sampling_params, use_tqdm, priority)

    def beam_search(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        params: BeamSearchParams,
        lora_request: LoRARequest | None = None,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search: per prompt, the `params.beam_width` best sequences (prompt
        tokens included, as vLLM returns them), chosen by transformers' rules
        (pagemesh/api/beam_search.py). Beams share their KV through the prefix cache."""
        del use_tqdm  # one round at a time: there is no per-prompt progress to show
        return beam_search(self, as_list(prompts), params, lora_request)

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> list[RequestOutput]:
        """Generates the assistant's reply to each conversation (`[{"role", "content"}, ...]`,
        or a list of them) through the model's chat template, with the `tools` it shows the
        model (OpenAI's function definitions). Messages are checked as the OpenAI API checks
        them (ValueError with its message)."""
        check_unused(kwargs, "chat")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        parsed = []
        for conversation in conversations:
            images: list[bytes] = []
            normalized = chat_messages(conversation, images)
            token_ids = self.tokenizer.apply_chat_messages(normalized, tools=tools)
            text = self.tokenizer.decode(token_ids, skip_special_tokens=False)
            if images:  # image_url parts (data: URLs), as the OpenAI API's
                parsed.append(
                    self._image_prompt({"prompt_token_ids": token_ids, "prompt": text}, images)
                )
            else:
                parsed.append(Prompt(text, token_ids))
        return self._run(parsed, sampling_params, use_tqdm, None)

    def embed(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        pooling_params: PoolingParams | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
        **kwargs: Any,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in order (vLLM's `LLM.embed`): an embedding model's
        pooled, normalised (where it says) vector; `pooling_params.dimensions` for
        Matryoshka models. Texts are tokenized with the special tokens the tokenizer adds."""
        check_unused(kwargs, "embed")
        prompts_, vectors = self._pool(prompts, pooling_params, use_tqdm)
        return [
            EmbeddingRequestOutput(request_id, EmbeddingOutput(vector.tolist()), ids)
            for (request_id, ids), vector in zip(prompts_, vectors)
        ]

    def encode(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        pooling_params: PoolingParams | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
        pooling_task: str = "embed",
        **kwargs: Any,
    ) -> list[PoolingRequestOutput]:
        """vLLM's `LLM.encode`: the pooled output per prompt as a tensor
        (`outputs.data`); only `pooling_task="embed"` is served."""
        import torch

        check_unused(kwargs, "encode")
        if pooling_task != "embed":
            raise ValueError(f'pooling_task {pooling_task!r} is not served; only "embed"')
        prompts_, vectors = self._pool(prompts, pooling_params, use_tqdm)
        return [
            PoolingRequestOutput(request_id, PoolingOutput(torch.from_numpy(vector)), ids)
            for (request_id, ids), vector in zip(prompts_, vectors)
        ]

    def _pool(
        self, prompts: Any, params: PoolingParams | None, use_tqdm: bool | Callable[..., Any]
    ) -> tuple[list[tuple[str, list[int]]], list]:
        engine = self._live_engine()
        pooling = self.info.pooling
        items = as_list(prompts)
        images = [image_input(p, pooling.image_tokens) for p in items]
        token_ids = [
            [0] * pooling.image_tokens if image else self._prompt(p).token_ids
            for p, image in zip(items, images)
        ]
        request_ids = [str(self._next_request_id + i) for i in range(len(token_ids))]
        requests = embedding_requests(
            request_ids, token_ids, params, pooling, self.limits.max_model_len, images
        )
        self._next_request_id += len(requests)
        progress = _progress_bar(use_tqdm, len(requests))
        sink = EmbedSink(request_ids, progress.update if progress is not None else None)
        try:
            engine.submit([[r] for r in requests], sink)
            while not sink.wait(WAIT_SLICE_S):
                pass
        except BaseException:
            engine.abort(request_ids)
            raise
        finally:
            if progress is not None:
                progress.close()
        if sink.error is not None:
            engine.abort(request_ids)
            raise RuntimeError(f"embedding failed: {sink.error}")
        return (
            list(zip(request_ids, token_ids)),
            [sink.vector(request_id) for request_id in request_ids],
        )

    def reset_prefix_cache(self) -> int:
        """Drops the cached prompt blocks no request holds (vLLM's `reset_prefix_cache`):
        later prompts recompute their KV. Returns the number of blocks dropped."""
        engine = self._live_engine()
        assert engine.engine_loop is not None
        return engine.call(engine.engine_loop.scheduler.reset_prefix_cache)

    def get_tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer."""
        return self.tokenizer.hf

    def close(self) -> None:
        """Stops the engine and any worker processes; idempotent. The LLM cannot generate
        afterwards."""
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        if self._workers is not None:
            self._workers.close()
            self._workers = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the finalizers stop the ranks
            pass

    # ------------------------------------------------------------------ internals

    def _live_engine(self) -> EngineCore:
        if self._engine is None:
            raise RuntimeError("this LLM was closed")
        return self._engine

    def _run(
        self,
        prompts: list[Prompt],
        sampling_params: Any,
        use_tqdm: bool | Callable[..., Any],
        priority: list[int] | None,
    ) -> list[RequestOutput]:
        engine = self._live_engine()
        if self.info.pooling.embeds:
            raise ValueError(
                f"{self.info.model_name} is an embedding model: it does not "
                "generate text; use LLM.embed or LLM.encode"
            )
        params = params_per_prompt(sampling_params, len(prompts))
        if priority is not None:
            if len(priority) != len(prompts):
                raise ValueError(f"priority has {len(priority)} values for {len(prompts)} prompts")
            for prompt, value in zip(prompts, priority):
                prompt.priority = value
        prepared = []
        for index, (prompt, p) in enumerate(zip(prompts, params)):
            request_id = str(self._next_request_id + index)
            try:
                prepared.append(
                    prepare(
                        request_id,
                        prompt,
                        p,
                        self.limits,
                        self._grammars,
                        self._seeds.getrandbits(63),
                    )
                )
            except ValueError as exc:  # the servers' message as it is; the index as a note
                exc.add_note(f"(prompt {index} of this call)")
                raise
        self._next_request_id += len(prompts)
        progress = _progress_bar(use_tqdm, len(prepared))
        sink = BatchSink(
            prepared,
            self.tokenizer,
            engine.engine_loop.abort,
            progress.update if progress is not None else None,
        )
        submitted = [r.request_id for request in prepared for r in request.core_requests]
        try:
            engine.submit([request.core_requests for request in prepared], sink)
            while not sink.wait(WAIT_SLICE_S):
                pass
        except BaseException:  # Ctrl-C, or a request that can never fit: stop them all
            engine.abort(submitted)
            raise
        finally:
            if progress is not None:
                progress.close()
        if sink.error is not None:
            engine.abort(submitted)
            raise RuntimeError(f"generation failed: {sink.error}")
        return sink.outputs()


def _progress_bar(use_tqdm: bool | Callable[..., Any], total: int) -> Any:
    if not use_tqdm:
        return None
    factory = use_tqdm
    if factory is True:
        try:
            from tqdm.auto import tqdm as factory
        except ImportError:
            return None
    return factory(total=total, desc="Processed prompts", dynamic_ncols=True)
