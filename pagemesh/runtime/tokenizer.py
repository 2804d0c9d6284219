"""Tokenizer loading for the router: a Hugging Face folder or a single `.gguf` file.

`load_tokenizer` is the only place that touches `transformers`; the rest of the router sees
the small `Tokenizer` wrapper below, whose decode never "cleans up" spaces so that decoding
a sequence in windows (see `router.detokenizer`) gives the same text as decoding it whole.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# Any of these in a folder means transformers can build a tokenizer from it.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")
# Files whose `eos_token_id` (an int or a list) adds to the tokenizer's own EOS token.
_EOS_CONFIG_FILES = ("generation_config.json", "config.json")


class TokenizerError(ValueError):
    """The tokenizer could not be loaded, or cannot do what was asked (e.g. no chat template)."""


class Tokenizer:
    """A loaded tokenizer with the few operations the router needs.

    Invariants: every id returned by `encode`/`apply_chat_template` is `< vocab_size`;
    `decode` is a pure function of its arguments (no space clean-up), so
    `decode(a + b) == decode(a) + decode(b)` whenever `a` ends on a complete character
    (always true for byte-level BPE when `decode(a)` does not end in U+FFFD).
    """

    def __init__(
        self, hf_tokenizer: PreTrainedTokenizerBase, eos_token_ids: list[int], source: str
    ):
        self._hf = hf_tokenizer
        self._eos_token_ids = eos_token_ids
        self.source = source
        # A fast tokenizer's Rust core decodes as `_hf.decode` does without space clean-up,
        # measured several times cheaper per call: the detokenizer calls it twice per
        # streamed token.
        self._rust = (
            getattr(hf_tokenizer, "_tokenizer", None)
            if getattr(hf_tokenizer, "is_fast", False)
            else None
        )

    def __repr__(self) -> str:
        return f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size})"

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added/special tokens included; valid ids are `0 .. vocab_size-1`."""
        return len(self._hf)

    @property
    def eos_token_ids(self) -> list[int]:
        """Ids that end generation: the tokenizer's EOS first, then any from the model's configs."""
        return list(self._eos_token_ids)

    @property
    def hf(self) -> PreTrainedTokenizerBase:
        """The Hugging Face tokenizer itself (structured output builds its vocabulary view
        from it, router/structured.py)."""
        return self._hf

    @property
    def has_chat_template(self) -> bool:
        return bool(self._hf.chat_template)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """Characters in the vocabulary's longest token string. No token covers more of a
        text than its string is long (a byte-level token's string has one character per
        byte), so a text of c characters is at least c / max_token_chars tokens."""
        return max((len(token) for token in self._hf.get_vocab()), default=1) or 1

    def min_num_tokens(self, num_chars: int) -> int:
        """A lower bound on the tokens of a text of `num_chars` characters (see above):
        known before a long text is tokenized at all."""
        return -(-num_chars // self.max_token_chars)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with the special tokens the model adds by default (e.g. BOS)."""
        return list(self._hf.encode(text, add_special_tokens=True))

    def apply_chat_template(self, user_text: str) -> list[int]:
        """Token ids of a one-message chat (`user_text` as the user), ending with the prompt
        that starts the assistant's turn. The template supplies its own BOS, so none is added.

        Raises TokenizerError when the model has no chat template.
        """
        return self.apply_chat_messages([{"role": "user", "content": user_text}])

    def apply_chat_messages(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Token ids of a chat (`{"role", "content"}` dicts, oldest first; an assistant's
        may carry `tool_calls`, a tool's its `tool_call_id`), ending with the prompt that
        starts the assistant's turn. The template supplies its own BOS. `tools`: OpenAI's
        function definitions, which the template shows the model (as Hugging Face's
        `apply_chat_template(tools=...)` takes them).

        Raises TokenizerError when the model has no chat template or the template rejects the
        messages (e.g. roles that do not alternate).
        """
        if not self.has_chat_template:
            raise TokenizerError(
                f"the model at {self.source} has no chat template; send a plain prompt instead "
                "of chat messages"
            )
        try:
            text = self._hf.apply_chat_template(
                messages, tools=tools or None, add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # jinja raises TemplateError (and friends) from the template
            raise TokenizerError(f"the chat template rejected the messages: {exc}") from exc
        return list(self._hf.encode(text, add_special_tokens=False))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids`; invalid or incomplete UTF-8 becomes U+FFFD."""
        if self._rust is not None:
            return self._rust.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return self._hf.decode(
            token_ids,
            skip_special_tokens=skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        """The vocabulary strings of `token_ids` (byte-level tokens look like 'Ġworld')."""
        return list(self._hf.convert_ids_to_tokens(token_ids))


def load_tokenizer(model_path: str) -> Tokenizer:
    """Load the tokenizer of a Hugging Face model folder or of a `.gguf` file (slower for GGUF,
    whose vocabulary transformers converts). Never touches the network.

    Raises TokenizerError with what to fix when the path holds no tokenizer.
    """
    path = Path(model_path)
    if not path.exists():
        raise TokenizerError(f"model path {model_path} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise TokenizerError(
                f"model path {model_path} is a file but not a .gguf file; pass a .gguf file or a "
                "Hugging Face model folder"
            )
        hf = _from_pretrained(str(path.parent), gguf_file=path.name)
        return Tokenizer(hf, _eos_token_ids(hf, config_dir=None), source=str(path))
    _check_folder_has_tokenizer(path)
    hf = _from_pretrained(str(path))
    return Tokenizer(hf, _eos_token_ids(hf, config_dir=path), source=str(path))


def _check_folder_has_tokenizer(folder: Path) -> None:
    if any((folder / name).is_file() for name in _TOKENIZER_FILES):
        return
    hint = ""
    gguf_files = sorted(p.name for p in folder.glob("*.gguf"))
    if gguf_files:
        hint = f"; it holds {gguf_files[0]}, pass that file's path instead"
    raise TokenizerError(
        f"model folder {folder} has no tokenizer (expected one of {', '.join(_TOKENIZER_FILES)})"
        + hint
    )


def _from_pretrained(folder: str, **kwargs: Any) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer  # heavy import, only needed when loading

    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True, **kwargs)
    except Exception as exc:  # transformers raises many types; the caller needs one
        where = f"{folder}/{kwargs['gguf_file']}" if "gguf_file" in kwargs else folder
        raise TokenizerError(f"could not load a tokenizer from {where}: {exc}") from exc


def _eos_token_ids(hf: PreTrainedTokenizerBase, config_dir: Path | None) -> list[int]:
    ids: list[int] = []
    if hf.eos_token_id is not None:
        ids.append(int(hf.eos_token_id))
    if config_dir is not None:
        for name in _EOS_CONFIG_FILES:
            ids.extend(_eos_ids_in_config(config_dir / name))
    return list(dict.fromkeys(ids))  # de-duplicate, keep order


def _eos_ids_in_config(config_file: Path) -> list[int]:
    if not config_file.is_file():
        return []
    try:
        value = json.loads(config_file.read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        logger.warning("ignoring unreadable %s", config_file)
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []
