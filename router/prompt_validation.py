"""A generation's input as `Generation` (router/generation.py) takes it in: the prompt
tokenized (a text, or chat messages through the model's template; long texts off the event
loop, and text that cannot fit refused before any tokenizing), its images fetched, checked
and expanded into their placeholders, its output constraint compiled, and the whole request
validated against the model's limits. Every refusal is INVALID_ARGUMENT with the reason."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from pagemesh.api.options.constraint import OutputConstraint
from pagemesh.api.options.validation import (
    ModelLimits,
    ValidatedRequest,
    ValidationError,
    check_unicode,
    validate,
)
from pagemesh.runtime.images import (
    ImageError,
    check_num_images,
    expand_images,
    image_token_count,
    load_image,
)
from pagemesh.runtime.media import MediaFetcher, RemoteImage
from pagemesh.runtime.serving import invalid_argument
from pagemesh.runtime.tokenizer import Tokenizer, TokenizerError
from protos.step import ImageInput
from router.structured import ConstraintError, GrammarCompiler
from router.types import GenerationRequest, ModelInfo

if TYPE_CHECKING:
    from router.generation import AdmissionLimits
    from router.group_directory import GroupDirectory

T = TypeVar("T")

OFF_LOOP_CHARS = 16_384  # texts longer than this are tokenized on a worker thread
# Characters of JSON of a chat request's tool definitions and calls, checked before the
# template renders them (a 16 MB `tools` list took the router's CPU for seconds).
MAX_TOOLS_CHARS = 1_000_000


class PromptValidation:
    """`Generation`'s inputs (it inherits this, and sets these in its __init__)."""

    tokenizer: Tokenizer
    media: MediaFetcher
    grammars: GrammarCompiler
    directory: GroupDirectory
    limits: AdmissionLimits

    async def tokenize(
        self, text: str, apply_chat_template: bool, owner: str = ""
    ) -> tuple[list[int], list[str]]:
        """The text's token ids and each one's text piece. INVALID_ARGUMENT for empty text;
        it takes an admission slot meanwhile, as a generation does."""
        with self._admitted(owner):
            token_ids = await self._tokenize(text, apply_chat_template, max_num_tokens=None)
        return token_ids, self.tokenizer.convert_ids_to_tokens(token_ids)

    async def tokenize_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        owner: str = "",
    ) -> list[int]:
        """Token ids of chat `messages` through the model's template (the OpenAI chat API's
        prompt), with the `tools` it shows the model. INVALID_ARGUMENT when the template
        rejects them, when they are not valid Unicode, or when they cannot fit the model
        whatever they tokenize to (tools included: they are refused by size before any
        rendering). It takes an admission slot meanwhile, as a generation does."""
        texts = [m["content"] for m in messages if isinstance(m.get("content"), str)]
        # Tool definitions and calls' arguments reach the template too.
        extra = json.dumps(
            [tools or [], [m.get("tool_calls") for m in messages]], ensure_ascii=False
        )
        if len(extra) > MAX_TOOLS_CHARS:
            raise invalid_argument(
                f"the tools and tool calls are {len(extra):,} characters of JSON; at most "
                f"{MAX_TOOLS_CHARS:,} are accepted: send fewer or shorter tool definitions"
            )
        with self._admitted(owner):
            for text in texts:
                _check_unicode(text, "a message's content")
            _check_unicode(extra, "the tools or tool calls")
            num_chars = sum(map(len, texts))
            await self._check_fits(num_chars, len(messages), await self._max_prompt_tokens())
            render = functools.partial(self.tokenizer.apply_chat_messages, tools=tools)
            try:
                return await _off_loop_if_long(num_chars + len(extra), render, messages)
            except TokenizerError as exc:
                raise invalid_argument(str(exc)) from exc

    async def _validate(
        self, request: GenerationRequest
    ) -> tuple[ValidatedRequest, tuple[ImageInput, ...]]:
        info = await self.directory.model_info()
        if info.pooling.embeds:
            raise invalid_argument(
                f"model {info.model!r} is an embedding model: it does not generate text; send "
                "its inputs to /v1/embeddings (gRPC: Embed)"
            )
        prompt = request.prompt
        if prompt is None:
            raise invalid_argument("the request has no prompt: set `text` or `token_ids`")
        if isinstance(prompt, str):
            prompt_ids = await self._tokenize(
                prompt, request.apply_chat_template, await self._max_prompt_tokens()
            )
        elif request.apply_chat_template:
            raise invalid_argument("apply_chat_template needs a `text` prompt, not `token_ids`")
        else:
            prompt_ids = prompt
        images: tuple[ImageInput, ...] = ()
        if request.images:
            prompt_ids, images = await self._with_images(prompt_ids, request.images, info)
        max_prompt_tokens = self.limits.max_prompt_tokens
        if max_prompt_tokens and len(prompt_ids) > max_prompt_tokens:
            raise invalid_argument(
                f"prompt has {len(prompt_ids)} tokens but this router accepts at most "
                f"{max_prompt_tokens} (--max-prompt-tokens); shorten the prompt"
            )
        limits = (await self.directory.model_info()).limits()
        grammar = await self._compile(request.constraint, limits)
        try:
            validated = validate(
                prompt_ids,
                request.sampling,
                request.stopping,
                request.num_logprobs,
                request.model,
                limits,
                n=request.n,
                priority=request.priority,
                grammar=grammar,
            )
        except ValidationError as exc:
            raise invalid_argument(str(exc)) from exc
        return validated, images

    async def _with_images(
        self, prompt_ids: list[int], images: list[bytes | RemoteImage], info: ModelInfo
    ) -> tuple[list[int], tuple[ImageInput, ...]]:
        """A vision-language prompt: each image fetched (an http(s) URL) and checked (decoded
        off the event loop, within the size and pixel limits), and each image token expanded
        into its image's placeholders. INVALID_ARGUMENT for images to a text-only model, too
        many, a URL not allowed or not fetched, one that is not an image, or image tokens
        that do not pair up with the images."""
        if not info.image_seq_length:
            raise invalid_argument(f"model {info.model!r} is a text-only model: it takes no images")
        limits = self.limits.images
        try:
            check_num_images(len(images), limits)
        except ImageError as exc:
            raise invalid_argument(str(exc)) from None
        data = await self.fetch_images(images, "image")
        counts = []
        for index, image in enumerate(data):
            try:
                decoded = await asyncio.to_thread(load_image, image, limits)
            except ImageError as exc:
                raise invalid_argument(f"image {index}: {exc}") from None
            counts.append(image_token_count(decoded, info.image_seq_length, info.image_tiling))
        try:
            return expand_images(prompt_ids, data, info.image_token_id, counts)
        except ValueError as exc:
            raise invalid_argument(str(exc)) from None

    async def fetch_images(self, items: list[T], what: str) -> list[T | bytes]:
        """`items` with each RemoteImage replaced by its bytes, fetched at once; the first
        that fails is INVALID_ARGUMENT naming it ("<what> <index>: why")."""
        remote = [(i, item) for i, item in enumerate(items) if isinstance(item, RemoteImage)]
        if not remote:
            return list(items)
        for index, item in remote:  # no I/O before every URL is allowed
            try:
                self.media.check_url(item.url)
            except ImageError as exc:
                raise invalid_argument(f"{what} {index}: {exc}") from None
        fetched = await asyncio.gather(
            *(self.media.fetch(item.url) for _, item in remote), return_exceptions=True
        )
        out: list[T | bytes] = list(items)
        for (index, _), result in zip(remote, fetched):
            if isinstance(result, ImageError):
                raise invalid_argument(f"{what} {index}: {result}") from None
            if isinstance(result, BaseException):
                raise result
            out[index] = result
        return out

    async def _compile(self, constraint: OutputConstraint | None, limits: ModelLimits) -> str:
        """The request's output constraint compiled and checked against the model's
        vocabulary (on a worker thread: the first one builds that view, slowly); "" for none.
        INVALID_ARGUMENT naming what is wrong, before anything is scheduled."""
        if constraint is None:
            return ""
        try:
            return await asyncio.to_thread(
                self.grammars.compile, constraint, limits.vocab_size, limits.eos_token_ids
            )
        except ConstraintError as exc:
            raise invalid_argument(str(exc)) from None

    async def _tokenize(
        self, text: str, apply_chat_template: bool, max_num_tokens: int | None
    ) -> list[int]:
        """`text` tokenized (long texts off the event loop, so that the router keeps answering
        meanwhile); refused before any work when it cannot fit `max_num_tokens`."""
        if not text:
            raise invalid_argument("the prompt is empty: send at least one character or token")
        _check_unicode(text, "the prompt")
        if max_num_tokens is not None:
            await self._check_fits(len(text), 1, max_num_tokens)
        encode = (
            self.tokenizer.apply_chat_template if apply_chat_template else self.tokenizer.encode
        )
        try:
            return await _off_loop_if_long(len(text), encode, text)
        except TokenizerError as exc:
            raise invalid_argument(str(exc)) from exc

    async def _max_prompt_tokens(self) -> int:
        """The most prompt tokens a request may have: the model's context, or less with
        --max-prompt-tokens."""
        max_model_len = (await self.directory.model_info()).limits().max_model_len
        limit = self.limits.max_prompt_tokens
        return min(max_model_len, limit) if limit else max_model_len

    async def _check_fits(self, num_chars: int, num_parts: int, max_num_tokens: int) -> None:
        """Refuses, before tokenizing, text that is too long whatever it tokenizes to."""
        at_least = max(self.tokenizer.min_num_tokens(num_chars), num_parts)
        if at_least > max_num_tokens:
            raise invalid_argument(
                f"the prompt ({num_chars:,} characters in {num_parts:,} part(s)) is at least "
                f"{at_least:,} tokens for this tokenizer, whose longest token is "
                f"{self.tokenizer.max_token_chars} characters, but at most {max_num_tokens:,} "
                "are accepted (the model's context, or --max-prompt-tokens); shorten it"
            )

    if TYPE_CHECKING:  # provided by Generation

        def _admitted(self, owner: str) -> contextlib.AbstractContextManager[None]: ...


async def _off_loop_if_long(num_chars: int, fn: Callable[[T], list[int]], arg: T) -> list[int]:
    """`fn(arg)` here for short texts (a thread hand-off costs more than they take), on a
    worker thread for long ones: a 16 MB prompt took seconds to tokenize, and a router whose event
    loop stops that long answers nothing, not even its health (and is then restarted as hung)."""
    if num_chars <= OFF_LOOP_CHARS:
        return fn(arg)
    return await asyncio.to_thread(fn, arg)


def _check_unicode(text: str, what: str) -> None:
    try:
        check_unicode(text, what)
    except ValidationError as exc:
        raise invalid_argument(str(exc)) from None
