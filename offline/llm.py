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
"""

from __future__ import annotations

import logging
import random
import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from offline.batch import BatchSink, Prompt, prepare
from offline.beam import BeamSearchOutput, beam_search
from offline.diagnostics import RankMemoryUsage, RankStepStats, memory_usage
from offline.embed import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    EmbedSink,
    PoolingOutput,
    PoolingParams,
    PoolingRequestOutput,
    embedding_requests,
    image_bytes,
    image_input,
)
from offline.engine import EngineCore
from offline.lora import AdapterChecks, LoRARequest, per_prompt
from offline.outputs import RequestOutput
from offline.setup import EngineSetup, build_engine, check_servable
from pagemesh.api.beam_search import BeamSearchParams
from pagemesh.api.sampling_params import SamplingParams
from pagemesh.runtime.images import expand_images, image_token_count, load_image
from pagemesh.runtime.speculative_config import SpeculativeConfig
from router.openai_protocol import chat_messages
from worker_svc.lora import LoraConfig

logger = logging.getLogger(__name__)

GIB = 1 << 30
MIB = 1 << 20
WAIT_SLICE_S = 0.2  # how often a waiting generate() wakes (so Ctrl-C is noticed)

# vLLM engine arguments a script may pass that change nothing here.
_IGNORED_VLLM_ARGS = frozenset(
    {
        "trust_remote_code",
        "enforce_eager",
        "disable_log_stats",
        "tokenizer_mode",
        "disable_custom_all_reduce",
        "compilation_config",
        "load_format",
        "download_dir",
    }
)

PromptInput = str | list[int] | dict[str, Any]
ChatMessages = list[dict[str, Any]]


class LLM:
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
        unknown = sorted(set(kwargs) - _IGNORED_VLLM_ARGS)
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
        _check_unused(kwargs, "generate")
        if prompts is None:
            prompts = prompt_token_ids  # vLLM's older keyword
        parsed = [self._prompt(p) for p in _as_list(prompts)]
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
        return beam_search(self, _as_list(prompts), params, lora_request)

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
        _check_unused(kwargs, "chat")
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
        _check_unused(kwargs, "embed")
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

        _check_unused(kwargs, "encode")
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
        items = _as_list(prompts)
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

    # ------------------------------------------------------------------ diagnostics
    # What the mesh's `pagemesh.v1.Admin` answers for a group (`pagemesh admin ...`), for
    # this engine's ranks. Ranks are listed in order: rank = pp_rank * tp_size + tp_rank.

    def get_memory(self) -> list[RankMemoryUsage]:
        """Each rank's memory now: `memory` (worker_svc.diagnostics.RankMemory: weights, KV
        cache and swap space as allocated, process RSS, CUDA allocator figures; bytes) and
        the engine's KV blocks in use and free, in blocks
        (`num_used_kv_blocks + num_free_kv_blocks == num_kv_blocks`) and bytes
        (`kv_cache_used_bytes`). Waits for the step in flight, if any."""
        engine = self._live_engine()
        memories = self._ranks.call("memory")
        assert engine.engine_loop is not None
        stats = engine.call(engine.engine_loop.scheduler.stats)
        return [
            memory_usage(rank, tp_rank, pp_rank, memory, stats, self._num_swap_blocks)
            for rank, ((tp_rank, pp_rank), memory) in enumerate(
                zip(self._ranks.layout(), memories, strict=True)
            )
        ]

    def get_step_stats(self, window_s: float = 60.0) -> list[RankStepStats]:
        """Each rank's step figures (`stats`, a worker_svc.diagnostics.StepStatsSnapshot):
        steps, busy seconds and, of them, collective and pipeline-transfer seconds, since
        the LLM started and over the last `window_s` seconds (at most an hour; shorter
        while the LLM is younger); `stats.utilization` is the window's busy fraction, 0..1.
        Raises ValueError unless `window_s > 0`."""
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0 (seconds), got {window_s!r}")
        self._live_engine()
        snapshots = self._ranks.call("snapshot", float(window_s))
        return [
            RankStepStats(rank, tp_rank, pp_rank, snapshot)
            for rank, ((tp_rank, pp_rank), snapshot) in enumerate(
                zip(self._ranks.layout(), snapshots, strict=True)
            )
        ]

    def start_profile(
        self, out_dir: str, *, record_shapes: bool = False, with_stack: bool = False
    ) -> None:
        """Starts a torch.profiler trace on every rank (CPU ops, and CUDA kernels on a
        GPU), on the thread that runs its steps; `stop_profile` writes one Chrome trace
        JSON per rank into `out_dir` (created now). Raises
        worker_svc.diagnostics.ProfilerStateError when a trace already runs, OSError when
        `out_dir` cannot be written."""
        self._live_engine()
        self._ranks.call("start_profile", str(out_dir), record_shapes, with_stack)

    def stop_profile(self) -> list[str]:
        """Stops the trace and writes it: the absolute path of each rank's trace file
        (`<out_dir>/pagemesh-pp<P>-tp<T>-<time>.json`, for chrome://tracing or Perfetto),
        in rank order. Raises ProfilerStateError when no trace runs."""
        self._live_engine()
        return [trace.path for trace in self._ranks.call("stop_profile")]

    def print_memory_stats(self, file: TextIO | None = None) -> None:
        """Prints `get_memory()` as a table, one line per rank (MiB, and KV blocks)."""
        out = file if file is not None else sys.stdout
        print(
            f"{'rank':>4} {'tp':>2} {'pp':>2} {'device':<8} {'weights':>9} "
            f"{'KV used/total blocks':>21} {'KV used':>9} {'KV alloc':>9} {'swap':>9} "
            f"{'RSS':>9}  (MiB)",
            file=out,
        )
        for m in self.get_memory():
            print(
                f"{m.rank:>4} {m.tp_rank:>2} {m.pp_rank:>2} {m.memory.device:<8} "
                f"{m.memory.weight_bytes / MIB:>9.1f} "
                f"{f'{m.num_used_kv_blocks}/{m.num_kv_blocks}':>21} "
                f"{m.kv_cache_used_bytes / MIB:>9.1f} {m.memory.kv_cache_bytes / MIB:>9.1f} "
                f"{m.memory.swap_bytes / MIB:>9.1f} {m.memory.rss_bytes / MIB:>9.1f}",
                file=out,
            )

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

    def _prompt(self, prompt: PromptInput) -> Prompt:
        if isinstance(prompt, dict):
            images = (prompt.get("multi_modal_data") or {}).get("image")
            if images is not None and not self.info.pooling.embeds:
                return self._image_prompt(prompt, images)
            if "prompt_token_ids" in prompt:
                return Prompt(prompt.get("prompt"), _token_ids(prompt["prompt_token_ids"]))
            prompt = prompt.get("prompt")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty: send at least one character or token")
            return Prompt(prompt, self.tokenizer.encode(prompt))
        return Prompt(None, _token_ids(prompt))

    def _image_prompt(self, prompt: dict, images: Any) -> Prompt:
        """vLLM's `{"prompt": "...<image>...", "multi_modal_data": {"image": one or a list}}`
        for a vision-language model: each image token of the prompt becomes the image's
        placeholders (as transformers' processor expands it), the images in order."""
        info = self.info
        if not info.image_seq_length:
            raise ValueError(
                f"{info.model_name} is a text-only model: it takes no multi_modal_data image"
            )
        images = images if isinstance(images, list) else [images]
        token_ids = (
            _token_ids(prompt["prompt_token_ids"])
            if "prompt_token_ids" in prompt
            else self.tokenizer.encode(prompt.get("prompt") or "")
        )
        data = [image_bytes(image) for image in images]
        counts = [
            image_token_count(load_image(image), info.image_seq_length, info.image_tiling)
            for image in data
        ]
        expanded, inputs = expand_images(token_ids, data, info.image_token_id, counts)
        return Prompt(prompt.get("prompt"), expanded, images=inputs)

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
        params = _params_per_prompt(sampling_params, len(prompts))
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


def _as_list(prompts: Any) -> list[Any]:
    """One prompt (text, token ids, a dict) or a list of them."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if (
        isinstance(prompts, Sequence)
        and prompts
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts)
    ):
        return [list(prompts)]  # one prompt of token ids
    if isinstance(prompts, Sequence) and not isinstance(prompts, (bytes, bytearray)):
        return list(prompts)
    raise ValueError(
        "prompts must be a string, a list of token ids, a prompt dict, or a "
        f"list of these; got {type(prompts).__name__}"
    )


def _token_ids(value: Any) -> list[int]:
    if (
        isinstance(value, Sequence)
        and not isinstance(value, (str, bytes))
        and value
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    ):
        return list(value)
    raise ValueError("prompt must be a non-empty string or a non-empty list of token ids")


def _params_per_prompt(sampling_params: Any, num_prompts: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    params = list(sampling_params)
    if len(params) != num_prompts:
        raise ValueError(
            f"sampling_params has {len(params)} entries for {num_prompts} "
            "prompts; give one for all, or one per prompt"
        )
    for p in params:
        if not isinstance(p, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(p).__name__}")
    return params


def _check_unused(kwargs: dict[str, Any], method: str) -> None:
    """vLLM's LoRA and multimodal arguments: refused when used, accepted when empty."""
    used = sorted(name for name, value in kwargs.items() if value is not None)
    if used:
        raise ValueError(f"{method}() does not support {', '.join(used)} in pagemesh")


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
