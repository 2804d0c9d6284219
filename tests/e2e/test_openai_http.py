"""The OpenAI HTTP API, driven by the official `openai` client, against a real mesh: it gives
the same tokens as gRPC `Generate` and OpenAI-shaped errors."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from pagemesh.runtime.ports import reserve_port
from protos.pagemesh.scheduler.v1 import scheduler_pb2
from protos.pagemesh.v1 import generate_pb2
from tests.support.eventually import eventually
from tests.support.mesh_harness import REPO_ROOT, Mesh, greedy_request, scheduler_stats

MODEL = "tiny-llama"
PROMPT_IDS = [5, 6, 7, 8, 9]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def http_url(
    tiny_llama_mesh: Mesh,
    tiny_llama_dir: Path,
    redis_url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[str]:
    # A second, stateless router on the mesh's cluster, serving HTTP on a free port.
    port = reserve_port()
    log_path = tmp_path_factory.mktemp("logs") / "http-router.log"
    log = open(log_path, "wb")
    router = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "router.main",
            "--model",
            str(tiny_llama_dir),
            "--port",
            str(reserve_port()),
            "--http-port",
            str(port),
            "--redis-url",
            redis_url,
            "--cluster",
            "e2e-llama",
            "--log-level",
            "WARNING",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO_ROOT,
    )
    url = f"http://127.0.0.1:{port}"
    try:

        def healthy() -> bool:
            assert router.poll() is None, log_path.read_text()
            return httpx.get(f"{url}/health", timeout=1).status_code == 200

        eventually(healthy, 60, log_path.read_text, interval_s=0.3, ignoring=(httpx.HTTPError,))
        yield url
    finally:
        router.terminate()
        assert router.wait(timeout=30) == 0, log_path.read_text()
        log.close()


@pytest.fixture(scope="module")
def client(http_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{http_url}/v1", api_key="x", max_retries=0, timeout=60)


def test_completion_equals_grpc_generate(client: openai.OpenAI, tiny_llama_mesh: Mesh) -> None:
    expected = tiny_llama_mesh.generate(greedy_request(PROMPT_IDS, 12))
    result = client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=12, **GREEDY)
    assert result.id.startswith("cmpl-") and result.object == "text_completion"
    assert result.model == MODEL
    assert [c.text for c in result.choices] == [expected.text]
    assert result.choices[0].finish_reason == "length"
    assert (
        result.usage.prompt_tokens,
        result.usage.completion_tokens,
        result.usage.total_tokens,
    ) == (len(PROMPT_IDS), 12, len(PROMPT_IDS) + 12)

    stream = client.completions.create(
        model=MODEL,
        prompt=PROMPT_IDS,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_chat_equals_grpc_chat_template(client: openai.OpenAI, tiny_llama_mesh: Mesh) -> None:
    request = generate_pb2.GenerateRequest(text="Hello there", apply_chat_template=True)
    request.sampling.temperature = 0.0
    request.stopping.max_tokens = 10
    request.stopping.ignore_eos = True
    expected = tiny_llama_mesh.generate(request)
    messages = [{"role": "user", "content": "Hello there"}]
    result = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, **GREEDY)
    assert result.id.startswith("chatcmpl-") and result.object == "chat.completion"
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content == expected.text
    assert result.usage.prompt_tokens == expected.prompt_tokens

    stream = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_completion_tokens=10, stream=True, **GREEDY
        )
    )
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == expected.text
    assert stream[-1].choices[0].finish_reason == "length"


def test_seeded_n2_stop_strings_and_logprobs(client: openai.OpenAI) -> None:
    sampled = client.completions.create(
        model=MODEL,
        prompt="Once upon",
        max_tokens=8,
        n=2,
        seed=7,
        temperature=1.0,
        extra_body={"ignore_eos": True},
    )
    again = client.completions.create(
        model=MODEL,
        prompt="Once upon",
        max_tokens=8,
        n=2,
        seed=7,
        temperature=1.0,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in sampled.choices) == [0, 1]
    assert [c.text for c in sampled.choices] == [c.text for c in again.choices]

    full = (
        client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=12, **GREEDY)
        .choices[0]
        .text
    )
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    stopped = client.completions.create(
        model=MODEL, prompt=PROMPT_IDS, max_tokens=12, stop=[stop], **GREEDY
    )
    assert stopped.choices[0].text == full[: full.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"

    with_lp = client.completions.create(
        model=MODEL, prompt=PROMPT_IDS, max_tokens=4, logprobs=2, **GREEDY
    )
    lp = with_lp.choices[0].logprobs
    assert (
        len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    )
    assert all(len(top) <= 2 and max(top.values()) <= 0 for top in lp.top_logprobs)
    assert "".join(lp.tokens) == with_lp.choices[0].text

    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
        **GREEDY,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)
    assert content[0].bytes == list(content[0].token.encode())


def test_models_and_health(client: openai.OpenAI, http_url: str) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{http_url}/health").status_code == 200


@pytest.mark.parametrize(
    "case", ["max_tokens 0", "negative temperature", "several prompts", "echo"]
)
def test_bad_requests_are_openai_400s(client: openai.OpenAI, case: str) -> None:
    kwargs: dict = {"model": MODEL, "prompt": "Hi", "max_tokens": 4}
    kwargs.update(
        {
            "max_tokens 0": {"max_tokens": 0},
            "negative temperature": {"temperature": -1},
            "several prompts": {"prompt": ["a", "b"]},
            "echo": {"echo": True},
        }[case]
    )
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**kwargs)
    assert info.value.body["message"] and info.value.body["type"] == "invalid_request_error"


def test_unknown_model_and_bad_json(client: openai.OpenAI, http_url: str) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "Hi"}]
        )
    assert info.value.code == "model_not_found"
    response = httpx.post(
        f"{http_url}/v1/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    response = httpx.post(f"{http_url}/v1/completions", json={"prompt": "Hi", "max_tokens": "4"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"


@pytest.mark.parametrize(
    "body, param, message",
    [
        ({"max_tokens": -1}, None, "max_tokens must be at least 1, got -1"),
        ({"seed": -5}, None, "seed must be in [0, 2**64 - 1], got -5"),
        ({"seed": 2**70}, "seed", "seed must be at most 2**64 - 1, got 1180591620717411303424"),
        ({"seed": 2**64}, "seed", "seed must be at most 2**64 - 1"),
        (
            {"messages": "notalist"},
            "messages",
            "messages must be a non-empty list of {role, content}",
        ),
        ({"top_k": 2**40}, "top_k", "top_k must be in [-2**31, 2**31 - 1]"),
        ({"priority": -(2**40)}, "priority", "priority must be in [-2**31, 2**31 - 1]"),
        ({"n": 2**70}, "n", "n must be at most 2**32 - 1"),
        ({"n": 2**31}, None, "n must be in 1..16 (samples of one prompt)"),
        ({"max_tokens": 4.0}, "max_tokens", "max_tokens must be an integer, got 4.0"),
        ({"temperature": True}, "temperature", "temperature must be a finite number, got True"),
        ({"temperature": 10**400}, "temperature", "temperature must be a finite number"),
        ({"stop": [["x"]]}, "stop", "stop must be a string or a list of strings"),
        ({"request_id": "x" * 300}, "request_id", "request_id has 300 characters; use at most 247"),
        ({"resume_from": 3}, None, "resume_from needs the id of the request to resume"),
    ],
)
def test_bad_input_is_a_400_that_says_what_to_fix(
    http_url: str, body: dict, param: str | None, message: str
) -> None:
    """Issue 21's fuzzer found these as HTTP 500s (ValueError: Value out of range)."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    response = httpx.post(f"{http_url}/v1/chat/completions", json={**chat, **body}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert message in error["message"]


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "not valid JSON"),
        (b"\xff\xfe{", "not valid JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "not valid JSON: nested too deeply"),
        (
            b'{"prompt": "Hi", "seed": ' + b"9" * 5000 + b"}",
            "not valid JSON",
        ),  # > Python's 4300 digits
        (b"null", "the request body must be a JSON object"),
        (b'["prompt"]', "the request body must be a JSON object"),
        (b'{"prompt": "Hi", "temperature": NaN}', "temperature must be a finite number, got nan"),
        (b'{"prompt": "Hi", "top_p": -Infinity}', "top_p must be a finite number, got -inf"),
    ],
)
def test_odd_bodies_are_400s(http_url: str, content: bytes, message: str) -> None:
    response = httpx.post(
        f"{http_url}/v1/completions",
        content=content,
        timeout=30,
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 400 and message in response.json()["error"]["message"]


def test_unknown_paths_and_methods_answer_in_openai_shape(http_url: str) -> None:
    for response, status in [
        (httpx.get(f"{http_url}/v1/nothing"), 404),
        (httpx.get(f"{http_url}/v1/completions"), 405),
    ]:
        assert response.status_code == status
        assert response.json()["error"]["type"] == "invalid_request_error"
    response = httpx.post(
        f"{http_url}/v1/completions",
        json={"prompt": "Hi", "max_tokens": 2},
        headers={"X-Resume-From": "two"},
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "X-Resume-From"


def test_token_ids_and_the_request_id_header(client: openai.OpenAI, tiny_llama_mesh: Mesh) -> None:
    """vLLM's `return_token_ids` and `X-Request-Id`: each chunk carries its choice's new token
    ids, every token in the chunk that brought it (a client counts them to resume)."""
    expected = tiny_llama_mesh.generate(greedy_request(PROMPT_IDS, 12))
    raw = client.completions.with_raw_response.create(
        model=MODEL,
        prompt=PROMPT_IDS,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
        extra_headers={"X-Request-Id": "ids-1"},
    )
    assert raw.headers["x-request-id"] == "ids-1"
    result = raw.parse()
    assert result.id == "cmpl-ids-1" and result.choices[0].token_ids == expected.token_ids
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=12,
        n=2,
        seed=3,
        stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    token_ids: dict[int, list[int]] = {0: [], 1: []}
    for chunk in stream:
        for choice in chunk.choices:
            token_ids[choice.index] += choice.model_extra.get("token_ids") or []
    assert [len(ids) for ids in token_ids.values()] == [12, 12]
    plain = client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=2)
    assert "token_ids" not in plain.choices[0].model_extra


LONG_CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Tell me a long story"}],
    "max_tokens": 400,
    "temperature": 0,
    "ignore_eos": True,
}


def assert_cancelled_before_its_end(redis_url: str, num_steps_at_send: int) -> None:
    """The request's blocks are freed after its client left, before its 400 tokens were done.
    Alone on the mesh, running to its end takes at least 400 steps (a token a step), so fewer
    steps from its sending to its blocks' release mean it was cancelled. Steps, not seconds:
    a disconnect takes ~3 steps of the tiny model to reach the scheduler on an idle Xeon, but
    a CI machine busy with the other pytest worker once took 305."""

    def freed() -> scheduler_pb2.GetStatsResponse | None:
        stats = scheduler_stats(redis_url, "e2e-llama")
        return (
            stats if stats.num_running == 0 and stats.num_free_blocks == stats.num_blocks else None
        )

    stats = eventually(
        freed,
        10,
        lambda: f"blocks still held: {scheduler_stats(redis_url, 'e2e-llama')}",
        interval_s=0.05,
    )
    assert stats.num_steps - num_steps_at_send < LONG_CHAT["max_tokens"], (
        "the request ran to its end after its client left"
    )


def test_client_disconnect_mid_stream_cancels_the_request(http_url: str, redis_url: str) -> None:
    body = {
        "model": MODEL,
        "prompt": list(range(1, 100)),
        "max_tokens": LONG_CHAT["max_tokens"],
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
    }
    num_steps_at_send = scheduler_stats(redis_url, "e2e-llama").num_steps
    with httpx.stream("POST", f"{http_url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        assert scheduler_stats(redis_url, "e2e-llama").num_running == 1
    assert_cancelled_before_its_end(redis_url, num_steps_at_send)


def test_client_disconnect_before_a_non_streaming_answer_cancels_the_request(
    http_url: str, redis_url: str
) -> None:
    """Issue 21: a chat request whose client had closed the connection was still running 30 s
    later, holding 7% of the KV cache. The client here hangs up while its answer computes."""
    url = httpx.URL(http_url)
    body = json.dumps({**LONG_CHAT, "stream": False}).encode()
    num_steps_at_send = scheduler_stats(redis_url, "e2e-llama").num_steps
    with socket.create_connection((url.host, url.port)) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        )
        eventually(
            lambda: scheduler_stats(redis_url, "e2e-llama").num_running == 1,
            30,
            "the request running",
            interval_s=0.02,
        )
    assert_cancelled_before_its_end(redis_url, num_steps_at_send)


def test_beam_search_equals_transformers_and_refuses_sampling(
    http_url: str, client: openai.OpenAI, tiny_llama_dir: Path
) -> None:
    """vLLM's `use_beam_search`: best_of beams, the n best returned, as transformers'
    generate(num_beams=best_of, num_return_sequences=n) gives them; streamed, the same
    choices come as events. Sampling options with it are a 400 naming them."""
    import torch
    from transformers import AutoModelForCausalLM

    prompt = [5, 17, 33, 101, 7, 250, 3, 9]
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 8,
        "n": 2,
        "best_of": 3,
        "use_beam_search": True,
        "length_penalty": 0.5,
        "return_token_ids": True,
    }
    answer = httpx.post(f"{http_url}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    choices = answer.json()["choices"]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model.generate(
            torch.tensor([prompt]),
            num_beams=3,
            num_return_sequences=2,
            length_penalty=0.5,
            do_sample=False,
            max_new_tokens=8,
            pad_token_id=0,
        )[:, len(prompt) :].tolist()
    assert [c["token_ids"] for c in choices] == expected
    assert answer.json()["usage"]["completion_tokens"] == 16
    streamed = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=8,
        n=2,
        best_of=3,
        stream=True,
        extra_body={"use_beam_search": True, "length_penalty": 0.5},
    )
    texts = {chunk.choices[0].index: chunk.choices[0].text for chunk in streamed if chunk.choices}
    assert [texts[0], texts[1]] == [c["text"] for c in choices]
    for extra, named in [
        ({"temperature": 0.8}, "temperature"),
        ({"n": 4}, "best_of"),
        ({"logprobs": 2}, "logprobs"),
        ({"stop": ["x"]}, "stop strings"),
    ]:
        refused = httpx.post(f"{http_url}/v1/completions", json={**body, **extra}, timeout=30)
        assert refused.status_code == 400 and named in refused.text, refused.text
