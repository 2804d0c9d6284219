"""pagemesh: the `pagemesh` command and the runtime every service shares, and the Python API.

The API is loaded on first use (module `__getattr__`), so `import pagemesh` stays light and
the command does not import torch:

- `LLM`, `SamplingParams`, `RequestOutput`, `CompletionOutput`: vLLM's offline API, the
  engine in this process (pagemesh/offline/);
- `Client`, `AsyncClient` and their errors: a running mesh over gRPC (pagemesh/sdk/).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Each public name and the module that defines it.
_EXPORTS = {
    "LLM": "pagemesh.offline.llm",
    "LoRARequest": "pagemesh.offline.lora",
    "RequestOutput": "pagemesh.offline.outputs",
    "CompletionOutput": "pagemesh.offline.outputs",
    "SamplingParams": "pagemesh.sampling_params",
    "BeamSearchParams": "pagemesh.beam_search",
    "PoolingParams": "pagemesh.offline.embed",
    "EmbeddingRequestOutput": "pagemesh.offline.embed",
    "PoolingRequestOutput": "pagemesh.offline.embed",
    "StructuredOutputsParams": "pagemesh.sampling_params",
    "Client": "pagemesh.sdk",
    "AsyncClient": "pagemesh.sdk",
    "PagemeshError": "pagemesh.sdk",
    "InvalidArgument": "pagemesh.sdk",
    "ResourceExhausted": "pagemesh.sdk",
    "Unavailable": "pagemesh.sdk",
    "NotFound": "pagemesh.sdk",
    "Unauthenticated": "pagemesh.sdk",
    "DeadlineExceeded": "pagemesh.sdk",
}

__all__ = ["__version__", *_EXPORTS]

if TYPE_CHECKING:  # for type checkers and editors: the names `__getattr__` loads
    from pagemesh.offline.llm import LLM  # noqa: F401
    from pagemesh.offline.lora import LoRARequest  # noqa: F401
    from pagemesh.offline.outputs import CompletionOutput, RequestOutput  # noqa: F401
    from pagemesh.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: F401
    from pagemesh.sdk import (AsyncClient, Client, DeadlineExceeded,  # noqa: F401
                              InvalidArgument, NotFound, PagemeshError, ResourceExhausted,
                              Unauthenticated, Unavailable)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pagemesh' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
