"""Load a Llama-family model from a Hugging Face folder or a GGUF file.

Every source is reduced to the same three things: a `ModelConfig`, metadata the rest of
the mesh needs (`ModelMetadata`), and a stream of (Hugging Face name, tensor) pairs
that `LlamaForCausalLM.load_weights` copies in.

Each rank reads only its own shard: the model, built for one rank on the meta device,
says per checkpoint name which slice it holds (`checkpoint_slice`), and the stream reads
just that slice (safetensors) or cuts it right after decoding (GGUF, worker_svc/loader_gguf.py).
Tensors of other pipeline stages are never read.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.cpu_features import CpuFeatures, cpu_features
from protos.step import ImageTiling, PoolingInfo
from worker_svc.model.config import ModelConfig, parse_hf_config
from worker_svc.model.llama import LlamaForCausalLM
from worker_svc.model.llava import LlavaConfig, is_llava_config, llava_checkpoint_name
from worker_svc.model.parallel_layers import Index, TPComm
from worker_svc.model.pooling import pooling_info
from worker_svc.parallel import ParallelConfig
from worker_svc.quant.config import resolve_quantization
from worker_svc.quant.gguf import GgufKeptLoad
from worker_svc.quant.loading import QuantizedLoad

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ARCHITECTURE_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}

# Checkpoint name -> the slice this rank reads, or None to skip the tensor.
WeightSelector = Callable[[str], Index | None]
WeightStream = Callable[[WeightSelector], Iterator[tuple[str, torch.Tensor]]]
# GGUF raw blocks: (name, GGML type name) -> the slice of uint8 [rows, bytes per row], or None.
BlockSelector = Callable[[str, str], Index | None]
BlockStream = Callable[[BlockSelector], Iterator[tuple[str, str, torch.Tensor]]]


@dataclass(frozen=True)
class ModelMetadata:
    name: str  # folder or file name, as the model is listed to clients
    architecture: str  # transformers class name, e.g. "LlamaForCausalLM"
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_model_len: int  # tokens: prompt + output
    dtype: torch.dtype
    # none | fp8 | awq | gguf-<types> (e.g. gguf-q4_1): how the linear layers' weights are held
    quantization: str = "none"
    path: str = ""  # the folder or .gguf file it was loaded from (its tokenizer lives there)
    pooling: PoolingInfo = PoolingInfo()  # what it does with a prompt: generate or embed
    # A vision-language model (LLaVA): the token an image's placeholders are, and how many
    # placeholders one image takes; -1 / 0 for a text model.
    image_token_id: int = -1
    image_seq_length: int = 0
    image_tiling: ImageTiling = ImageTiling()  # LLaVA-NeXT's (placeholders follow the size)


@dataclass(frozen=True)
class ModelSource:
    """What a checkpoint says before any weight is read."""

    config: ModelConfig
    name: str
    architecture: str
    eos_token_ids: tuple[int, ...]
    weights: WeightStream
    quantization_config: dict | None = None  # config.json's, when the checkpoint has one
    gguf_tensor_types: dict[str, str] | None = None  # GGUF: HF name -> GGML type name
    gguf_blocks: BlockStream | None = None  # GGUF: the raw blocks of quantized tensors
    # The dtype the weights are stored in (config.json's dtype / torch_dtype, a GGUF's float
    # tensors); None when unknown or quantized.
    stored_dtype: torch.dtype | None = None
    folder: Path | None = None  # a HF folder's path (None for a .gguf file)
    hf_config: dict | None = None  # a HF folder's config.json
    llava: LlavaConfig | None = None  # a LLaVA folder's (its decoder is `config`)


def resolve_dtype(
    name: str,
    device: torch.device | str,
    stored: torch.dtype | None = None,
    features: CpuFeatures | None = None,
) -> torch.dtype:
    """The compute dtype for `--dtype name`. "auto" is bfloat16 on accelerators; on CPU it is
    what is fast on *this* CPU (`features`, default the probed one): bfloat16 only where the
    CPU multiplies bf16 natively (AVX512_BF16 or AMX; elsewhere bf16 is emulated, far slower
    than fp32: `python -m bench.peers.peak`) and oneDNN runs bf16 linear layers, and the checkpoint
    is not stored in fp32
    (`stored`; an fp32 checkpoint stays exact). Otherwise float32."""
    if name == "auto":
        if torch.device(device).type != "cpu":
            return torch.bfloat16
        features = features or cpu_features()
        fast_bf16 = features.native_bf16 and features.onednn_bf16_linear
        chosen = torch.bfloat16 if fast_bf16 and stored != torch.float32 else torch.float32
        logger.info(
            "dtype auto -> %s on CPU (%s; native bf16 %s, checkpoint %s)",
            str(chosen).removeprefix("torch."),
            features.one_line(),
            fast_bf16,
            "unknown/quantized" if stored is None else str(stored).removeprefix("torch."),
        )
        return chosen
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose auto, {', '.join(DTYPES)}")
    if name == "bfloat16" and torch.device(device).type == "cpu":
        slow = (features or cpu_features()).why_bf16_is_slow()
        if slow:
            logger.warning(
                "--dtype bfloat16 as asked, but %s; --dtype auto picks float32 here", slow
            )
    return DTYPES[name]


def open_source(path: str | Path) -> ModelSource:
    """A HF folder (config.json + *.safetensors), a .gguf file, or a folder holding one."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return _open_gguf(path)
    if path.is_dir() and (path / "config.json").is_file():
        return _open_hf_folder(path)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _open_gguf(ggufs[0])
    raise FileNotFoundError(
        f"{path} is neither a Hugging Face model folder (config.json + *.safetensors) "
        "nor a .gguf file"
    )


def load_model(
    path: str | Path,
    *,
    dtype: str = "auto",
    device: torch.device | str = "cpu",
    max_model_len: int | None = None,
    parallel: ParallelConfig | None = None,
    comm: TPComm | None = None,
    quantization: str = "auto",
    gguf_keep_quantized: bool = False,
    task: str = "auto",
) -> tuple[LlamaForCausalLM, ModelMetadata]:
    """Build this rank's part of the model (`parallel`; default: the whole model) on
    `device` in `dtype` and fill it from the checkpoint at `path`, reading only that part.
    `comm` carries the tensor-parallel collectives (the rank's DistributedContext).
    `quantization` (auto | none | fp8 | awq; auto = what the checkpoint says) chooses how
    the decoder's linear layers hold their weights (worker_svc/quant);
    `gguf_keep_quantized` keeps a GGUF's quantized linear layers in their blocks
    (worker_svc/quant/gguf.py) instead of dequantizing them here. `task` (auto | generate |
    embed) says whether it samples tokens or pools embeddings (worker_svc/model/pooling.py):
    an embedding model has no LM head."""
    device = torch.device(device)
    source = open_source(path)
    pooling = pooling_info(
        source.folder, source.hf_config or {}, source.architecture, task, source.config.hidden_size
    )
    torch_dtype = resolve_dtype(dtype, device, source.stored_dtype)
    quant = resolve_quantization(quantization, source.quantization_config)
    if gguf_keep_quantized and (source.gguf_blocks is None or quant.method != "none"):
        raise ValueError(
            "--gguf-keep-quantized needs a .gguf model and --quantization "
            f"auto or none (got {path}, quantization {quant.method})"
        )
    config = source.config
    limit = config.max_position_embeddings
    if max_model_len is not None and not 0 < max_model_len <= limit:
        raise ValueError(
            f"max_model_len={max_model_len} must be in 1..{limit} (the model's "
            "max_position_embeddings / context_length)"
        )
    # Build on the meta device so no memory is spent on a random init, then materialise
    # directly in the target dtype on the target device.
    with torch.device("meta"):
        model = LlamaForCausalLM(
            config, max_model_len or limit, parallel, comm, lm_head=not pooling.embeds
        )
    quantized = QuantizedLoad(model, quant) if quant.method != "none" else None
    kept = GgufKeptLoad(model, source.gguf_tensor_types) if gguf_keep_quantized else None
    for load in (quantized, kept):
        if load is not None:
            load.free_weights()  # before materialising: plain copies never take memory
    model = model.to(dtype=torch_dtype).to_empty(device=device)
    model.model.rotary.build_tables(device)  # fp32 tables, whatever the weights' dtype
    if quantized is not None:
        model.load_weights(quantized.wrap(source.weights(quantized.select)))
    elif kept is not None:
        kept.fill(source.gguf_blocks(kept.select_blocks))  # before: load_weights checks
        model.load_weights(source.weights(kept.select))
    else:
        model.load_weights(source.weights(model.checkpoint_slice))
    model.eval()
    metadata = ModelMetadata(
        name=source.name,
        architecture=source.architecture,
        vocab_size=config.vocab_size,
        eos_token_ids=source.eos_token_ids,
        max_model_len=max_model_len or limit,
        dtype=torch_dtype,
        quantization=kept.quantization if kept is not None else quant.method,
        path=str(path),
        pooling=pooling,
        image_token_id=source.llava.image_token_index if source.llava else -1,
        image_seq_length=source.llava.image_seq_length if source.llava else 0,
        image_tiling=source.llava.tiling if source.llava else ImageTiling(),
    )
    logger.info(
        "loaded %s (%s) from %s as %s (quantization %s) on %s (%s)",
        metadata.name,
        metadata.architecture,
        path,
        torch_dtype,
        metadata.quantization,
        device,
        model.parallel,
    )
    return model, metadata


def rank_weight_shapes(path: str | Path, parallel: ParallelConfig) -> dict[str, tuple[int, ...]]:
    """The parameter shapes one rank holds, from the checkpoint's config alone (no weight
    is read): for tests, and to size a deployment before starting it."""
    source = open_source(path)
    with torch.device("meta"):
        model = LlamaForCausalLM(source.config, 1, parallel)
    return {name: tuple(param.shape) for name, param in model.named_parameters()}


def check_architecture(hf_config: dict, folder: Path) -> None:
    """Raises ValueError naming a folder's architecture when this loader cannot build it
    (a vision-language model's nested `text_config`, an encoder, another family), before
    any of its keys is read as a decoder's."""
    model_type = hf_config.get("model_type", "")
    architectures = hf_config.get("architectures") or []
    if is_llava_config(hf_config):
        text_type = (hf_config.get("text_config") or {}).get("model_type", "llama")
        if text_type not in ARCHITECTURE_BY_MODEL_TYPE:
            raise ValueError(
                f"{folder}: a LLaVA whose language model is {text_type!r} is not "
                f"served here; its decoder must be one of "
                f"{', '.join(sorted(ARCHITECTURE_BY_MODEL_TYPE))}"
            )
        return
    served = set(ARCHITECTURE_BY_MODEL_TYPE.values())
    bare = {name.replace("ForCausalLM", "Model") for name in served}
    unknown = [a for a in architectures if a not in served | bare]
    if model_type not in ARCHITECTURE_BY_MODEL_TYPE or unknown:
        raise ValueError(
            f"{folder}: architecture {', '.join(architectures) or '(none given)'} (model_type "
            f"{model_type or '(none)'}) is not served here; decoders served: "
            f"{', '.join(sorted(served))} (and their *Model trunks as embedding models), "
            "and CLIPModel for embeddings"
        )


def _open_hf_folder(folder: Path) -> ModelSource:
    hf_config = json.loads((folder / "config.json").read_text())
    check_architecture(hf_config, folder)
    if is_llava_config(hf_config):
        return _open_llava_folder(folder, hf_config)
    config = parse_hf_config(hf_config)
    architectures = hf_config.get("architectures") or [
        ARCHITECTURE_BY_MODEL_TYPE[config.model_type]
    ]
    files = _safetensors_files(folder)

    # A model without an LM head (`Qwen3Model`, an embedding folder such as
    # Qwen3-Embedding's) names its trunk's tensors without the `model.` prefix.
    def hf_name(stored: str) -> str:
        return stored if stored.startswith(("model.", "lm_head.")) else "model." + stored

    def weights(select: WeightSelector) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        for file in files:
            with safe_open(str(file), framework="pt") as tensors:
                for stored in tensors.keys():
                    name = hf_name(stored)
                    index = select(name)
                    if index is not None:
                        # get_slice reads only the selected bytes of the mapped file.
                        yield name, tensors.get_slice(stored)[index]

    return ModelSource(
        config=config,
        name=folder.name,
        architecture=architectures[0],
        eos_token_ids=_hf_eos_token_ids(folder, hf_config),
        weights=weights,
        quantization_config=hf_config.get("quantization_config"),
        stored_dtype=DTYPES.get(hf_config.get("dtype") or hf_config.get("torch_dtype") or ""),
        folder=folder,
        hf_config=hf_config,
    )


def _open_llava_folder(folder: Path, hf_config: dict) -> ModelSource:
    """A LLaVA folder's decoder (its text_config and language-model tensors, in either
    naming, as the decoder's names); the image encoder is loaded apart
    (`worker_svc.model.llava.load_llava_encoder`)."""
    llava = LlavaConfig.from_dict(hf_config)
    files = _safetensors_files(folder)

    def weights(select: WeightSelector) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        for file in files:
            with safe_open(str(file), framework="pt") as tensors:
                for stored in tensors.keys():
                    kind, name = llava_checkpoint_name(stored)
                    if kind != "text":
                        continue
                    index = select(name)
                    if index is not None:
                        yield name, tensors.get_slice(stored)[index]

    text = llava.text
    eos = _hf_eos_token_ids(folder, text) or _hf_eos_token_ids(folder, hf_config)
    return ModelSource(
        config=parse_hf_config(text),
        name=folder.name,
        architecture=(hf_config.get("architectures") or ["LlavaForConditionalGeneration"])[0],
        eos_token_ids=eos,
        weights=weights,
        stored_dtype=DTYPES.get(
            text.get("dtype") or hf_config.get("dtype") or hf_config.get("torch_dtype") or ""
        ),
        folder=folder,
        hf_config=hf_config,
        llava=llava,
    )


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    return files


def _as_id_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _hf_eos_token_ids(folder: Path, hf_config: dict) -> tuple[int, ...]:
    """config.json's eos ids, then any extra ones generation_config.json adds (chat models
    often list their end-of-turn token only there)."""
    ids = _as_id_list(hf_config.get("eos_token_id"))
    generation_config = folder / "generation_config.json"
    if generation_config.is_file():
        ids += _as_id_list(json.loads(generation_config.read_text()).get("eos_token_id"))
    return tuple(dict.fromkeys(ids))


def _open_gguf(path: Path) -> ModelSource:
    from worker_svc.loader_gguf import open_gguf  # the GGUF reader, only for .gguf models

    return open_gguf(path)
