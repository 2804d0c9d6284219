"""Input that would stall the router is refused or moved off its event loop: found by the
fuzzer (bench/fuzz), where a 16 MB prompt held the loop for 8 s, the router answered no
health check meanwhile and was killed as hung, failing every stream it carried.

- a text that cannot fit the model whatever it tokenizes to is refused before tokenizing;
- a long text the router must tokenize is tokenized on a worker thread;
- an HTTP body past --max-message-bytes is a 413, said by Content-Length or found while
  reading; a prompt with a lone surrogate (JSON allows "\\ud800") is a 400, not a 500."""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx
import pytest

from pagemesh.runtime.tokenizer import Tokenizer, load_tokenizer
from protos.pagemesh.v1 import generate_pb2
from router.http_api import build_http_app
from tests.support.bpe_folder import write_bpe_folder
from tests.support.scripted_router import Router, run

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return load_tokenizer(str(write_bpe_folder(tmp_path_factory.mktemp("bpe"), CHAT_TEMPLATE)))


def test_a_text_too_long_for_the_model_is_refused_before_tokenizing(
    tokenizer: Tokenizer, redis_url: str
) -> None:
    async def scenario() -> None:
        async with Router(tokenizer, redis_url) as router:
            await router.add_scheduler("a")
            text = "lorem ipsum " * 1_000_000  # 12 MB: seconds of tokenizing
            started = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await router.generate(generate_pb2.GenerateRequest(text=text))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "at most 1,024 are accepted" in info.value.details()
            assert (
                f"longest token is {tokenizer.max_token_chars} characters" in info.value.details()
            )
            assert time.monotonic() - started < 2.0

    run(scenario())


def test_a_long_text_is_tokenized_while_the_router_keeps_answering(
    tokenizer: Tokenizer, redis_url: str
) -> None:
    """Tokenize has no model limit: 1 MB of text is tokenized on a worker thread, and health
    checks keep being answered meanwhile."""

    async def scenario() -> None:
        async with Router(tokenizer, redis_url) as router:
            await router.add_scheduler("a")
            text = "the quick brown fox " * 50_000
            tokenize = asyncio.ensure_future(
                router.stub.Tokenize(generate_pb2.TokenizeRequest(text=text), timeout=60)
            )
            slowest_s = 0.0
            while not tokenize.done():
                started = time.monotonic()
                await router.health()
                slowest_s = max(slowest_s, time.monotonic() - started)
                await asyncio.sleep(0.05)
            assert list((await tokenize).token_ids) == tokenizer.encode(text)
            assert slowest_s < 0.5, f"a health check waited {slowest_s:.2f} s"

    run(scenario())


def http_client(router: Router, max_body_bytes: int) -> httpx.AsyncClient:
    app = build_http_app(router.generation, lambda: True, max_body_bytes=max_body_bytes)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router")


def test_http_bodies_past_the_limit_are_413_and_lone_surrogates_400(
    tokenizer: Tokenizer, redis_url: str
) -> None:
    async def scenario() -> None:
        async with Router(tokenizer, redis_url) as router, http_client(router, 2_000) as http:
            await router.add_scheduler("a")
            big = {"prompt": "x" * 3_000, "max_tokens": 2}
            reply = await http.post("/v1/completions", json=big)  # Content-Length says it
            assert reply.status_code == 413, reply.text
            assert "past this router's limit of 2,000" in reply.json()["error"]["message"]

            async def chunks():  # no Content-Length: found while reading
                for _ in range(10):
                    yield b'{"prompt": "' + b"y" * 500

            reply = await http.post("/v1/completions", content=chunks())
            assert reply.status_code == 413, reply.text

            raw = '{"prompt": "bad \\ud800 text", "max_tokens": 2}'
            reply = await http.post(
                "/v1/completions", content=raw, headers={"content-type": "application/json"}
            )
            assert reply.status_code == 400, reply.text
            assert "not valid Unicode" in reply.json()["error"]["message"]
            raw = '{"messages": [{"role": "user", "content": "a \\udfff b"}], "max_tokens": 2}'
            reply = await http.post(
                "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}
            )
            assert reply.status_code == 400, reply.text
            assert "a message's content is not valid Unicode" in reply.json()["error"]["message"]
            reply = await http.post("/v1/completions", json={"prompt": "fine", "max_tokens": 2})
            assert reply.status_code == 200, reply.text  # and the router serves on

    run(scenario())
