"""Pooling models: what a folder says about embedding (`pooling_info`), and the pooling head
that turns a request's final hidden states into one vector (`Pooler`).

A folder embeds when (as vLLM decides its runner):
- its architecture has no LM head (`Qwen3Model`, `LlamaModel`, `Qwen2Model`, `MistralModel`),
- or it is a sentence-transformers folder: `modules.json` with a `Pooling` module (its
  `config.json` says the pooling) and maybe `Normalize`,
- or `--task embed` says so for any decoder this worker runs (vLLM's `--runner pooling`).
Without a sentence-transformers Pooling module the pooling is vLLM's default for decoders:
the last token's hidden state, normalised. Matryoshka `dimensions` are accepted where
config.json declares them (`matryoshka_dimensions`, or `is_matryoshka: true` for any).

The vector of a request: final-norm hidden states of its prompt rows; "last": the last
row's, "mean": their mean, "cls": the first row's; cut to `dimensions`, then scaled to unit
L2 norm where the folder normalises (vLLM's order), in fp32.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from protos.step import PoolingInfo

TASKS = ("auto", "generate", "embed")
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
_ST_TRANSFORMER = "sentence_transformers.models.Transformer"
# sentence-transformers Pooling config key -> pooling type (the modes this head computes).
_POOLING_MODES = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}
_UNSUPPORTED_MODES = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)


def is_bare_model(architecture: str) -> bool:
    """An architecture without an LM head, e.g. `Qwen3Model` (checkpoint names carry no
    `model.` prefix)."""
    return architecture.endswith("Model") and not architecture.endswith("ForCausalLM")


def pooling_info(
    folder: Path | None, hf_config: dict, architecture: str, task: str, hidden_size: int
) -> PoolingInfo:
    """What the model at `folder` (None for a .gguf file) does: `task` "auto" follows the
    folder, "generate" / "embed" force it. Raises ValueError naming what cannot be served
    (a pooling mode or sentence-transformers module this head does not compute, a bare
    model asked to generate)."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, not {task!r}")
    modules = _st_modules(folder)
    embeds = task == "embed" or (
        task == "auto"
        and (is_bare_model(architecture) or any(m["type"] == _ST_POOLING for m in modules))
    )
    if not embeds:
        if is_bare_model(architecture):
            raise ValueError(
                f"{architecture} has no LM head: it cannot generate; serve it with "
                "--task embed (or auto)"
            )
        return PoolingInfo()
    pooling_type, normalize = "last", True
    if modules:
        pooling_type, normalize = _st_pooling(folder, modules)
    dims = hf_config.get("matryoshka_dimensions") or ()
    return PoolingInfo(
        task="embed",
        pooling_type=pooling_type,
        normalize=normalize,
        embedding_size=hidden_size,
        matryoshka_dimensions=tuple(sorted(int(d) for d in dims if 0 < int(d) <= hidden_size)),
        any_dimensions=bool(hf_config.get("is_matryoshka")) and not dims,
    )


def _st_modules(folder: Path | None) -> list[dict]:
    if folder is None or not (folder / "modules.json").is_file():
        return []
    modules = json.loads((folder / "modules.json").read_text())
    if not isinstance(modules, list):
        raise ValueError(f"{folder / 'modules.json'}: expected a list of modules")
    return modules


def _st_pooling(folder: Path, modules: list[dict]) -> tuple[str, bool]:
    """(pooling type, normalize) from a sentence-transformers folder's modules, which must
    be the transformer, a Pooling, and optionally Normalize, in that order."""
    kinds = [m.get("type", "") for m in modules]
    unknown = [k for k in kinds if k not in (_ST_TRANSFORMER, _ST_POOLING, _ST_NORMALIZE)]
    if unknown:
        raise ValueError(
            f"sentence-transformers module {unknown[0]} ({folder / 'modules.json'}) "
            "is not supported: pooling models here are a transformer, a Pooling "
            "module and optionally Normalize"
        )
    pooling = next((m for m in modules if m["type"] == _ST_POOLING), None)
    if pooling is None:
        return "last", _ST_NORMALIZE in kinds
    config_file = folder / pooling.get("path", "1_Pooling") / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    odd = [key for key in _UNSUPPORTED_MODES if config.get(key)]
    chosen = [kind for key, kind in _POOLING_MODES.items() if config.get(key)]
    if odd or len(chosen) != 1:
        raise ValueError(
            f"{config_file}: exactly one of {', '.join(_POOLING_MODES)} must be "
            f"set (got {', '.join(odd + chosen) or 'none'})"
        )
    return chosen[0], _ST_NORMALIZE in kinds


@dataclass
class PoolingState:
    """One request's pooling so far, kept across its prefill chunks on the pooling rank."""

    total: torch.Tensor | None = None  # "mean": fp32 sum of the rows seen; "cls": row 0
    num_rows: int = 0


@dataclass(frozen=True)
class PoolSegment:
    """An embedding request's rows in this step's batch."""

    request_id: str
    start_row: int  # first row in the flat batch
    num_rows: int
    first_position: int  # position of its first row in the prompt
    completes: bool  # the step computes the prompt's last token
    dimensions: int  # 0 = full


class Pooler:
    """The pooling head of an embedding model: `pool` per step on the last stage's rows."""

    def __init__(self, info: PoolingInfo) -> None:
        if not info.embeds:
            raise ValueError("a Pooler needs an embedding model's PoolingInfo")
        self.info = info
        self.states: dict[str, PoolingState] = {}

    def forget(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def pool(
        self, final: Callable[[torch.Tensor], torch.Tensor], segments: list[PoolSegment]
    ) -> dict[str, bytes]:
        """`final(rows)`: the final-norm hidden states [len(rows), hidden] of batch rows
        `rows`. Returns the finished requests' vectors (float32 little-endian bytes)."""
        per_segment = [self._rows(segment) for segment in segments]
        flat = [row for rows in per_segment for row in rows]
        hidden = final(torch.tensor(flat, dtype=torch.long)).float() if flat else None
        out: dict[str, bytes] = {}
        offset = 0
        for segment, rows in zip(segments, per_segment):
            vectors = hidden[offset : offset + len(rows)] if rows else None
            offset += len(rows)
            vector = self._accumulate(segment, vectors)
            if vector is not None:
                out[segment.request_id] = self._finish(vector, segment.dimensions)
        return out

    def _rows(self, s: PoolSegment) -> list[int]:
        """The batch rows a segment's pooling reads this step."""
        kind = self.info.pooling_type
        if kind == "mean":
            return list(range(s.start_row, s.start_row + s.num_rows))
        if kind == "cls":
            return [s.start_row] if s.first_position == 0 else []
        return [s.start_row + s.num_rows - 1] if s.completes else []

    def _accumulate(
        self, segment: PoolSegment, vectors: torch.Tensor | None
    ) -> torch.Tensor | None:
        """Adds this step's rows to the request's state; its vector once it completes."""
        kind = self.info.pooling_type
        if kind == "last":
            return vectors[0] if segment.completes and vectors is not None else None
        state = self.states.setdefault(segment.request_id, PoolingState())
        if segment.first_position == 0:
            state.total, state.num_rows = None, 0  # a recompute starts over
        if kind == "cls":
            if vectors is not None:
                state.total = vectors[0].clone()
        elif vectors is not None:
            step_sum = vectors.sum(dim=0)
            state.total = step_sum if state.total is None else state.total + step_sum
            state.num_rows += len(vectors)
        if not segment.completes:
            return None
        del self.states[segment.request_id]
        if state.total is None:
            raise ValueError(
                f"request {segment.request_id}: its pooled rows were never "
                "computed here (a prompt must be recomputed from its start)"
            )
        return state.total if kind == "cls" else state.total / state.num_rows

    def _finish(self, vector: torch.Tensor, dimensions: int) -> bytes:
        if dimensions:
            vector = vector[:dimensions]
        if self.info.normalize:
            vector = torch.nn.functional.normalize(vector, p=2, dim=0)
        return vector.contiguous().numpy().astype("<f4").tobytes()
