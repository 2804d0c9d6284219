"""pagemesh: distributed LLM inference as a gRPC mesh. The package is split by who uses it:

- pagemesh/runtime/: what every service shares (config, registry, serving, telemetry, ...);
- pagemesh/api/: the client API (`SamplingParams`, request options, the gRPC SDK);
- pagemesh/tools/: the `pagemesh` command, `pagemesh top`, the load generator, test models.

The offline engine (`LLM`) is the top-level package `offline/`, above the services. The
public names below are loaded on first use (module `__getattr__`), so `import pagemesh`
stays light and the command does not import torch:

- `LLM`, `SamplingParams`, `RequestOutput`, `CompletionOutput`: vLLM's offline API, the
  engine in this process (offline/);
- `Client`, `AsyncClient` and their errors: a running mesh over gRPC (pagemesh/api/sdk/).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pagemesh.runtime.version import VERSION as __version__

# Each public name and the module that defines it.
_EXPORTS = {
    "LLM": "offline.llm",
    "LoRARequest": "offline.lora",
    "RequestOutput": "offline.outputs",
    "CompletionOutput": "offline.outputs",
    "SamplingParams": "pagemesh.api.sampling_params",
    "BeamSearchParams": "pagemesh.api.beam_search",
    "PoolingParams": "offline.embed",
    "EmbeddingRequestOutput": "offline.embed",
    "PoolingRequestOutput": "offline.embed",
    "StructuredOutputsParams": "pagemesh.api.sampling_params",
    "Client": "pagemesh.api.sdk",
    "AsyncClient": "pagemesh.api.sdk",
    "PagemeshError": "pagemesh.api.sdk",
    "InvalidArgument": "pagemesh.api.sdk",
    "ResourceExhausted": "pagemesh.api.sdk",
    "Unavailable": "pagemesh.api.sdk",
    "NotFound": "pagemesh.api.sdk",
    "Unauthenticated": "pagemesh.api.sdk",
    "DeadlineExceeded": "pagemesh.api.sdk",
}

__all__ = ["__version__", *_EXPORTS]

# For type checkers and editors: the client API's names. The offline engine's (`LLM` and its
# outputs) are named only as strings above: `offline/` is the floor above the services, and
# the package they all import never imports it back (`from offline.llm import LLM` types it).
if TYPE_CHECKING:
    from pagemesh.api.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: F401
    from pagemesh.api.sdk import (  # noqa: F401
        AsyncClient,
        Client,
        DeadlineExceeded,
        InvalidArgument,
        NotFound,
        PagemeshError,
        ResourceExhausted,
        Unauthenticated,
        Unavailable,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pagemesh' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
