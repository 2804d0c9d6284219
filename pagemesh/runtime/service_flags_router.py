"""The options only the router takes: routing across engine groups, resuming streams, API
keys, admission limits, request and image sizes, tool-call parsing.
"""

from __future__ import annotations

from typing import Any

from pagemesh.runtime.service_flags_base import ROUTER, ServiceFlag


def _router(name: str, help: str, **kwargs: Any) -> ServiceFlag:
    return ServiceFlag(name, (ROUTER,), help, **kwargs)


ROUTER_ONLY_OPTIONS = (
    _router(
        "--routing",
        "how requests are spread over engine groups",
        default="prefix_aware",
        choices=("round_robin", "least_load", "prefix_aware"),
    ),
    _router(
        "--balance-abs-threshold-tokens",
        "prefix_aware yields to least_load when its group has this many more outstanding "
        "tokens than the least loaded one ...",
        type=int,
        default=4096,
    ),
    _router("--balance-rel-threshold", "... and this many times as many", type=float, default=1.5),
    _router(
        "--discovery-interval-s",
        "seconds between registry polls for engine groups",
        type=float,
        default=1.0,
    ),
    _router(
        "--resume-timeout-s",
        "how long a request whose engine group failed mid-stream waits for another group "
        "(or the failed one's replacement) to take it back, seconds",
        type=float,
        default=120.0,
    ),
    _router(
        "--api-key",
        "API key clients must send as `authorization: Bearer <key>` (repeatable); no key "
        "and no --api-keys-file = open access. Prefer the file or PAGEMESH_API_KEY (keys "
        "separated by spaces): a command line is readable by every user of the host",
        repeatable=True,
        secret=True,
    ),
    _router(
        "--admin-api-key",
        "API key that may also call the Admin service (profiles, prefix cache resets, "
        "memory and step statistics), repeatable; inference keys get PERMISSION_DENIED "
        "there. Prefer `<key> admin` in --api-keys-file or PAGEMESH_ADMIN_API_KEY",
        repeatable=True,
        secret=True,
    ),
    _router(
        "--api-keys-file",
        "file of accepted API keys, one a line, each optionally followed by its scope "
        "(`inference`, the default, or `admin`); `#` starts a comment",
    ),
    _router(
        "--stream-interval",
        "tokens per streamed client message: 1 sends each token as it comes, N coalesces "
        "N (fewer, larger messages for clients that prefer throughput)",
        type=int,
        default=1,
    ),
    _router(
        "--max-queued-requests",
        "requests in flight through the router; more are refused (RESOURCE_EXHAUSTED / "
        "HTTP 429); also bounds the gRPC streams one connection may open and the HTTP "
        "connections served at once",
        type=int,
        default=1024,
    ),
    _router(
        "--max-requests-per-key",
        "requests in flight per API key (generations, tokenizations, chat template "
        "renderings); more are refused (RESOURCE_EXHAUSTED / HTTP 429 with Retry-After). "
        "0 = no per-key limit",
        type=int,
        default=0,
    ),
    _router(
        "--max-prompt-tokens",
        "longest prompt accepted, tokens; 0 = the model's context",
        type=int,
        default=0,
    ),
    _router(
        "--max-message-bytes",
        "largest request the router accepts, bytes: a gRPC message on its public port, "
        "an HTTP body on the OpenAI API (413 past it)",
        type=int,
        default=16 * 1024 * 1024,
    ),
    _router(
        "--allowed-media-domains",
        "host names the router may fetch http(s) image URLs from (OpenAI image_url "
        "parts), compared exactly (no subdomains); repeatable or comma-separated. None "
        "(the default) = only data: URLs and image bytes are accepted",
        repeatable=True,
    ),
    _router(
        "--media-fetch-timeout-s",
        "seconds one image URL may take to fetch, redirects included",
        type=float,
        default=10.0,
    ),
    _router(
        "--max-image-mib",
        "largest image a request may carry or point to, MiB (encoded)",
        type=float,
        default=20.0,
    ),
    _router(
        "--max-image-pixels",
        "largest image, width x height pixels (read from its "
        "header before decoding: a decompression bomb costs nothing)",
        type=int,
        default=40_000_000,
    ),
    _router("--max-images-per-request", "images one request may carry", type=int, default=16),
    _router(
        "--tool-call-parser",
        "how the model writes tool calls (OpenAI chat `tools`): hermes (Qwen2/Qwen3, "
        "<tool_call> blocks), llama3_json, mistral ([TOOL_CALLS]); auto picks by the "
        "model's architecture, then its chat template, else hermes",
        default="auto",
        choices=("auto", "hermes", "llama3_json", "mistral"),
    ),
)
