"""What a vLLM script hands `LLM` (offline/llm.py), read: prompts in any of vLLM's forms
(a text, token ids, a prompt dict, with images for a vision-language model; one or a list)
as `Prompt`s (offline/batch.py), `SamplingParams` one for all prompts or one per prompt,
and vLLM's arguments pagemesh does not take: ignored where they change nothing here,
refused when used otherwise."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from offline.batch import Prompt
from offline.embed import image_bytes
from pagemesh.api.sampling_params import SamplingParams
from pagemesh.runtime.images import expand_images, image_token_count, load_image

if TYPE_CHECKING:
    from pagemesh.runtime.tokenizer import Tokenizer
    from worker_svc.runner_config import RunnerInfo

PromptInput = str | list[int] | dict[str, Any]
ChatMessages = list[dict[str, Any]]

# vLLM engine arguments a script may pass that change nothing here.
IGNORED_VLLM_ARGS = frozenset(
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


class PromptReading:
    """`LLM`'s prompts (it inherits this, and sets these in its __init__)."""

    tokenizer: Tokenizer
    info: RunnerInfo  # the driver rank's

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


def as_list(prompts: Any) -> list[Any]:
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


def params_per_prompt(sampling_params: Any, num_prompts: int) -> list[SamplingParams]:
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


def check_unused(kwargs: dict[str, Any], method: str) -> None:
    """vLLM's LoRA and multimodal arguments: refused when used, accepted when empty."""
    used = sorted(name for name, value in kwargs.items() if value is not None)
    if used:
        raise ValueError(f"{method}() does not support {', '.join(used)} in pagemesh")
