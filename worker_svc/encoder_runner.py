"""The runner of an encoder-only embedding model (CLIP: worker_svc/model/clip.py), beside the
decoders' `ModelRunner`, with the same step contract.

There is no KV cache: the scheduler's blocks only meter its budget. Each request's tower
runs once, in the step that completes its prompt (a text input: its token ids through the
text tower; an image input: the image, decoded and preprocessed by the folder's image
processor, through the vision tower; its placeholder ids only count in the budget). The
projections' outputs are normalised (cosine similarity is what CLIP's space is for), as
vLLM's CLIP embeddings are. One rank only: the towers are small, and tensor or pipeline
parallelism is refused at load.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pagemesh.runtime.images import ClipImageProcessor, load_image
from protos.step import ModelRunnerOutput, PoolingInfo, PoolingParams, SchedulerOutput
from worker_svc.distributed import DistributedContext
from worker_svc.loader import ModelMetadata, resolve_dtype
from worker_svc.model.clip import ClipConfig, is_clip_folder, load_clip
from worker_svc.parallel import ParallelConfig

logger = logging.getLogger(__name__)

__all__ = ["EncoderRunner", "is_encoder_model"]


def is_encoder_model(path: str) -> bool:
    """Whether `path` holds a model `EncoderRunner` serves (a CLIPModel folder)."""
    return Path(path).is_dir() and is_clip_folder(path)


@dataclass
class _EncoderRequest:
    token_ids: list[int]
    pooling: PoolingParams
    num_computed_tokens: int = 0


@dataclass
class _Budget:
    """What the scheduler sizes itself by: blocks of `block_size` tokens (no memory)."""

    num_blocks: int
    block_size: int
    bytes_per_block: int = 0


class EncoderRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        metadata: ModelMetadata,
        processor: ClipImageProcessor,
        *,
        num_blocks: int,
        block_size: int,
        device: torch.device | str = "cpu",
        dist: DistributedContext | None = None,
    ) -> None:
        self.model = model
        self.metadata = metadata
        self.processor = processor
        self.device = torch.device(device)
        self.parallel = ParallelConfig()
        self.dist = dist or DistributedContext.single(self.device)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_swap_blocks = 0
        self.kv_spec = _Budget(num_blocks, block_size)  # diagnostics read bytes_per_block
        self.requests: dict[str, _EncoderRequest] = {}

    @classmethod
    def from_config(cls, config, dist: DistributedContext | None = None) -> EncoderRunner:
        """`config`: the worker's RunnerConfig. Raises ValueError for a layout or task an
        encoder cannot take."""
        if config.parallel.world_size > 1:
            raise ValueError(
                "a CLIP model runs on one rank: its towers are small; serve it "
                "with --tp 1 --pp 1 (use --replicas for more throughput)"
            )
        if config.task == "generate":
            raise ValueError("a CLIP model embeds; it cannot generate (--task generate)")
        dtype = resolve_dtype(config.dtype, config.device)
        clip = ClipConfig.from_folder(config.model_path)
        model = load_clip(config.model_path, dtype, device=config.device)
        text, vision = clip.text, clip.vision
        image_tokens = vision.num_patches + 1 if vision is not None else 0
        max_text = text.max_position_embeddings if text is not None else 0
        max_model_len = max(max_text, image_tokens)
        pooling = PoolingInfo(
            task="embed",
            pooling_type="clip",
            normalize=True,
            embedding_size=clip.projection_dim or 0,
            image_tokens=image_tokens,
            max_text_tokens=max_text,
        )
        metadata = ModelMetadata(
            name=Path(config.model_path).name,
            architecture="CLIPModel",
            vocab_size=text.vocab_size if text is not None else 1,
            eos_token_ids=(text.eos_token_id,) if text is not None else (),
            max_model_len=max_model_len,
            dtype=dtype,
            path=config.model_path,
            pooling=pooling,
        )
        per_request = -(-max_model_len // config.block_size)
        num_blocks = config.num_blocks or per_request * config.max_num_seqs
        logger.info(
            "CLIP model %s: text up to %d tokens, images as %d tokens, %d-d embeddings",
            metadata.name,
            max_text,
            image_tokens,
            pooling.embedding_size,
        )
        return cls(
            model,
            metadata,
            ClipImageProcessor.from_folder(config.model_path),
            num_blocks=num_blocks,
            block_size=config.block_size,
            device=config.device,
            dist=dist,
        )

    def info(self):
        from worker_svc.runner_config import RunnerInfo

        metadata = self.metadata
        return RunnerInfo(
            model_name=metadata.name,
            architecture=metadata.architecture,
            vocab_size=metadata.vocab_size,
            eos_token_ids=metadata.eos_token_ids,
            max_model_len=metadata.max_model_len,
            dtype=str(metadata.dtype).removeprefix("torch."),
            num_blocks=self.num_blocks,
            num_swap_blocks=0,
            block_size=self.block_size,
            num_layers=0,
            hidden_size=0,
            num_kv_heads=0,
            head_dim=0,
            weight_bytes=sum(p.numel() * p.element_size() for p in self.model.parameters()),
            kv_cache_sizing=f"{self.num_blocks} blocks, budget only (an encoder keeps no KV)",
            pooling=metadata.pooling,
        )

    def reset_requests(self) -> None:
        self.requests.clear()

    def reset_expert_placement(self) -> None:
        """No experts here."""

    @torch.inference_mode()
    def execute_step(self, step: SchedulerOutput) -> ModelRunnerOutput:
        """Runs the towers of the requests this step completes; ValueError (nothing
        changed) for a step that does not fit."""
        self._validate(step)
        for request_id in step.finished_request_ids:
            self.requests.pop(request_id, None)
        for new in step.new_requests:
            self.requests[new.request_id] = _EncoderRequest(
                list(new.token_ids), new.pooling, new.num_computed_tokens
            )
        start_s = time.perf_counter()
        done = []
        for request_id, num_tokens in step.num_scheduled_tokens.items():
            request = self.requests[request_id]
            request.num_computed_tokens += num_tokens
            if request.num_computed_tokens == len(request.token_ids):
                done.append(request_id)
        pooled = self._embed(done) if done else {}
        return ModelRunnerOutput(
            step.step_id, pooled=pooled, forward_time_ms=(time.perf_counter() - start_s) * 1000.0
        )

    def _validate(self, step: SchedulerOutput) -> None:
        finished = set(step.finished_request_ids)
        known = {r for r in self.requests if r not in finished}
        for new in step.new_requests:
            if new.pooling is None:
                raise ValueError(
                    f"request {new.request_id!r}: this model embeds (a pooling "
                    "model): it samples no tokens"
                )
            if not new.pooling.image and len(new.token_ids) > self.metadata.pooling.max_text_tokens:
                raise ValueError(
                    f"request {new.request_id!r}: a text input is at most "
                    f"{self.metadata.pooling.max_text_tokens} tokens here"
                )
            known.add(new.request_id)
        for request_id in step.num_scheduled_tokens:
            if request_id not in known:
                raise ValueError(f"unknown request {request_id!r} scheduled")

    def _embed(self, request_ids: list[str]) -> dict[str, bytes]:
        texts = [r for r in request_ids if not self.requests[r].pooling.image]
        images = [r for r in request_ids if self.requests[r].pooling.image]
        vectors: dict[str, torch.Tensor] = {}
        if texts:
            out = self.model.text_embeddings([self.requests[r].token_ids for r in texts])
            vectors.update(zip(texts, out))
        if images:
            pixels = self.processor.preprocess(
                [load_image(self.requests[r].pooling.image) for r in images]
            )
            dtype = next(self.model.parameters()).dtype
            out = self.model.image_embeddings(torch.from_numpy(pixels).to(self.device, dtype))
            vectors.update(zip(images, out))
        pooled = {}
        for request_id, vector in vectors.items():
            vector = torch.nn.functional.normalize(vector.float(), dim=0)
            pooled[request_id] = vector.cpu().numpy().astype("<f4").tobytes()
        return pooled


def load_runner(config, dist: DistributedContext | None = None):
    """The runner for `config.model_path`: an `EncoderRunner` for a CLIP folder, else the
    decoders' `ModelRunner`."""
    from worker_svc.runner import ModelRunner

    if is_encoder_model(config.model_path):
        return EncoderRunner.from_config(config, dist)
    return ModelRunner.from_config(config, dist)
