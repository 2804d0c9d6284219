"""Resuming an OpenAI HTTP answer after its router died (docs/fault-tolerance.md), with
the official `openai` client: the client names its request with `X-Request-Id`, counts the
output tokens of each choice it received (`return_token_ids`), and after the router's
SIGKILL asks the restarted router for the rest (`X-Resume-From`, or the `resume_from` body
field), getting exactly what it lacks and then the live rest, as an undisturbed run gives it.

First through a real router in-process over scripted schedulers (exact offsets, per choice),
then through a live mesh (`pagemesh up` restarts the killed router)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest

from pagemesh.api.options.validation import SamplingOptions, StoppingOptions, ValidatedRequest
from pagemesh.runtime.checkpoints import FINISHED, ORPHANED, Checkpoint, SampleState
from pagemesh.runtime.ports import reserve_port
from pagemesh.runtime.tokenizer import Tokenizer, load_tokenizer
from router import convert
from router.http_api import build_http_app
from router.types import Submission
from tests.support.bpe_folder import write_bpe_folder
from tests.support.eventually import eventually
from tests.support.mesh_harness import Mesh, alive, entries, scheduler_stats
from tests.support.scripted_router import SEED, Router, expected, run

# --- a real router in-process over scripted schedulers ---------------------------------


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return load_tokenizer(str(write_bpe_folder(tmp_path_factory.mktemp("bpe"))))


async def save_checkpoint(
    router: Router, request_id: str, samples: list[SampleState], max_tokens: int
) -> None:
    """What a scheduler keeps of a request whose router died: the request and each sample's
    tokens (seeded: the scripted scheduler continues them as the undisturbed run would)."""
    validated = ValidatedRequest(
        router.tokenizer.encode("Hello world"),
        SamplingOptions(seed=SEED),
        StoppingOptions(max_tokens=max_tokens),
        None,
        n=len(samples),
    )
    mesh_id = router.generation.tenancy.mesh_request_id("", request_id)  # keys off: no owner
    raw = convert.submit_request(Submission.fresh(mesh_id, validated, 0)).SerializeToString()
    state = FINISHED if all(s.finished for s in samples) else ORPHANED
    await router.registry.checkpoints.save(
        [Checkpoint(mesh_id, "a", raw, samples, state)], ttl_s=30
    )


def http_client(router: Router) -> httpx.AsyncClient:
    app = build_http_app(router.generation, lambda: True)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router")


def test_each_choice_resumes_from_its_own_count(tokenizer: Tokenizer, redis_url: str) -> None:
    """Choice 0 finished with 5 tokens of which the client has 3, choice 1 has 2 of 5 in the
    checkpoint and the client only 1: each gets exactly the rest of its own tokens."""

    async def scenario() -> None:
        async with Router(tokenizer, redis_url) as router, http_client(router) as http:
            await router.add_scheduler("a")
            full = [expected(tokenizer, 5, i) for i in range(2)]
            body = {"prompt": "ignored on a resume", "return_token_ids": True}
            await save_checkpoint(
                router, "cmpl-job-1", [SampleState(full[0], True, 1), SampleState(full[1][:2])], 5
            )
            reply = await http.post(
                "/v1/completions",
                json={**body, "resume_from": [3, 1]},
                headers={"X-Request-Id": "job-1"},
            )
            assert reply.status_code == 200, reply.text
            assert reply.headers["x-request-id"] == "job-1" and reply.json()["id"] == "cmpl-job-1"
            choices = reply.json()["choices"]
            assert [c["token_ids"] for c in choices] == [full[0][3:], full[1][1:]]
            assert [c["text"] for c in choices] == [
                tokenizer.decode(f)[len(tokenizer.decode(f[:k])) :] for f, k in zip(full, (3, 1))
            ]
            assert reply.json()["usage"]["completion_tokens"] == 10

            await save_checkpoint(
                router, "cmpl-job-2", [SampleState(full[0][:4]), SampleState(full[1][:4])], 5
            )
            async with http.stream(
                "POST",
                "/v1/completions",
                json={**body, "stream": True},
                headers={"X-Request-Id": "job-2", "X-Resume-From": "4,2"},
            ) as stream:
                events = [line async for line in stream.aiter_lines() if line.startswith("data: {")]
            got: dict[int, list[int]] = {0: [], 1: []}
            for event in events:
                for choice in httpx.Response(200, content=event[6:]).json()["choices"]:
                    got[choice["index"]] += choice["token_ids"]
            assert got == {0: full[0][4:], 1: full[1][2:]}

            missing = await http.post(
                "/v1/completions",
                json={**body, "resume_from": 2},
                headers={"X-Request-Id": "never-seen"},
            )
            assert missing.status_code == 404
            assert "has no checkpoint to resume from" in missing.json()["error"]["message"]
            await save_checkpoint(
                router, "cmpl-job-3", [SampleState(full[0][:4]), SampleState(full[1][:4])], 5
            )
            mismatch = await http.post(
                "/v1/completions",
                json={**body, "resume_from": [1, 1, 1]},
                headers={"X-Request-Id": "job-3"},
            )
            assert mismatch.status_code == 400
            assert "resume_from has 3 counts but the request has 2 samples" in mismatch.text
            # Without a resume the same id is a new request: it runs, the checkpoint unread.
            new = await http.post(
                "/v1/completions", json={**body, "max_tokens": 3}, headers={"X-Request-Id": "job-3"}
            )
            assert len(new.json()["choices"][0]["token_ids"]) == 3
            mesh_id = router.generation.tenancy.mesh_request_id("", "cmpl-job-3")
            assert [r.request_id for r in router.schedulers[0].requests][-1] == mesh_id

    run(scenario())


# --- a live mesh whose router is SIGKILLed mid-answer -----------------------------------

CLUSTER = "e2e-openai-resume"
MODEL = "tiny-llama"
MAX_TOKENS = 160
CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Once upon a time"}],
    "n": 2,
    "seed": 11,
    "temperature": 1.0,
    "top_p": 0.95,
    "max_tokens": MAX_TOKENS,
    "logprobs": True,
    "top_logprobs": 2,
    "extra_body": {"ignore_eos": True, "return_token_ids": True},
}


@dataclass
class LiveMesh:
    mesh: Mesh
    http_url: str
    redis_url: str

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.http_url}/v1", api_key="x", max_retries=0, timeout=120
        )

    def router_pid(self) -> int:
        """The live, ready router's pid (a killed one's entry outlives it by a TTL)."""

        def live() -> list[int]:
            return [
                e["pid"]
                for e in entries(self.redis_url, CLUSTER, "router").values()
                if e.get("status", "ready") == "ready" and alive(e["pid"])
            ]

        return eventually(live, 60, "a live router")[0]

    def kill_router(self) -> None:
        """SIGKILL; returns once `pagemesh up` restarted it and it serves HTTP again."""
        pid = self.router_pid()
        os.kill(pid, signal.SIGKILL)

        def serving_again() -> bool:
            return (
                self.router_pid() != pid
                and httpx.get(f"{self.http_url}/health", timeout=1).status_code == 200
            )

        eventually(
            serving_again,
            120,
            lambda: f"no restarted router:\n{self.mesh.log()}",
            interval_s=0.2,
            ignoring=(httpx.HTTPError,),
        )


@pytest.fixture(scope="module")
def live(
    tiny_llama_dir: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveMesh]:
    http_port = reserve_port()  # fixed: the restarted router serves on it again
    log = tmp_path_factory.mktemp("logs") / "openai-resume.log"
    mesh = Mesh(
        str(tiny_llama_dir),
        log,
        redis_url=redis_url,
        cluster=CLUSTER,
        extra_args=["--num-kv-blocks", "256", "--http-port", str(http_port)],
    )
    try:
        mesh.wait_ready()
        url = f"http://127.0.0.1:{http_port}"
        eventually(
            lambda: httpx.get(f"{url}/health", timeout=1).status_code == 200,
            60,
            mesh.log,
            ignoring=(httpx.HTTPError,),
        )
        yield LiveMesh(mesh, url, redis_url)
    finally:
        mesh.stop()


@dataclass
class Answer:
    """What a client holds of each choice: text, token ids, (token, logprob, top) per token."""

    text: dict[int, str] = field(default_factory=lambda: {0: "", 1: ""})
    token_ids: dict[int, list[int]] = field(default_factory=lambda: {0: [], 1: []})
    logprobs: dict[int, list[tuple]] = field(default_factory=lambda: {0: [], 1: []})
    finish_reasons: dict[int, str] = field(default_factory=dict)

    def add(
        self,
        index: int,
        text: str | None,
        token_ids: list[int] | None,
        logprobs: list,
        finish_reason: str | None,
    ) -> None:
        assert index not in self.finish_reasons, f"choice {index} got more after it finished"
        self.text[index] += text or ""
        self.token_ids[index] += token_ids or []
        self.logprobs[index] += [
            (lp.token, lp.logprob, [t.logprob for t in lp.top_logprobs]) for lp in logprobs
        ]
        if finish_reason is not None:
            self.finish_reasons[index] = finish_reason

    def add_chunk(self, chunk: openai.types.chat.ChatCompletionChunk) -> None:
        for c in chunk.choices:
            self.add(
                c.index,
                c.delta.content,
                c.model_extra.get("token_ids"),
                c.logprobs.content if c.logprobs and c.logprobs.content else [],
                c.finish_reason,
            )

    def resume_from(self) -> str:
        return ",".join(str(len(self.token_ids[i])) for i in (0, 1))

    def assert_equals(self, undisturbed: Answer) -> None:
        assert self.token_ids == undisturbed.token_ids
        assert self.text == undisturbed.text and self.finish_reasons == undisturbed.finish_reasons
        for index in (0, 1):  # replayed: exact; computed after the resume: within a batch's noise
            assert len(self.logprobs[index]) == MAX_TOKENS
            for got, want in zip(self.logprobs[index], undisturbed.logprobs[index]):
                assert got[0] == want[0] and got[1] == pytest.approx(want[1], abs=1e-4)
                assert got[2] == pytest.approx(want[2], abs=1e-4)


def test_a_stream_resumes_on_the_restarted_router_without_gap_or_repeat(live: LiveMesh) -> None:
    client = live.client()
    undisturbed = Answer()
    for chunk in client.chat.completions.create(**CHAT, stream=True):
        undisturbed.add_chunk(chunk)
    assert [len(undisturbed.token_ids[i]) for i in (0, 1)] == [MAX_TOKENS, MAX_TOKENS]

    answer, broke = Answer(), False
    stream = client.chat.completions.create(
        **CHAT, stream=True, extra_headers={"X-Request-Id": "story-1"}
    )
    try:
        for chunk in stream:
            answer.add_chunk(chunk)
            if len(answer.token_ids[0]) == 8 and not broke:
                broke = True
                live.kill_router()  # the client reads on: what was sent before the kill is its
    except (httpx.HTTPError, openai.APIError):
        pass
    received = [len(answer.token_ids[i]) for i in (0, 1)]
    assert broke and received < [MAX_TOKENS, MAX_TOKENS], "the router died mid-stream"
    resumed = client.chat.completions.create(
        **CHAT,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"X-Request-Id": "story-1", "X-Resume-From": answer.resume_from()},
    )
    chunks = list(resumed)
    for chunk in chunks:
        if chunk.choices:
            answer.add_chunk(chunk)
    print(
        f"received {received} tokens per choice before the router's SIGKILL; "
        f"the resumed stream gave the rest"
    )
    answer.assert_equals(undisturbed)
    assert not any(
        c.choices[0].delta.role for c in chunks if c.choices and received[c.choices[0].index]
    )
    assert chunks[-1].usage.completion_tokens == 2 * MAX_TOKENS


def test_a_non_streaming_answer_is_resumed_from_nothing(live: LiveMesh) -> None:
    """The router dies while computing a non-streaming answer (the client has nothing);
    the same request again with its X-Request-Id and `resume_from: 0` gets the whole
    answer, the part computed before the kill replayed from the checkpoint."""
    client = live.client()
    body = {**CHAT, "n": 2, "max_tokens": MAX_TOKENS}
    undisturbed = client.chat.completions.create(**body)
    failures: list[BaseException] = []

    def ask() -> None:
        try:
            client.chat.completions.create(**body, extra_headers={"X-Request-Id": "report-1"})
        except BaseException as exc:  # noqa: BLE001 - the failure is the point
            failures.append(exc)

    asker = threading.Thread(target=ask)
    asker.start()
    eventually(
        lambda: scheduler_stats(live.redis_url, CLUSTER).num_running == 2,
        60,
        "the request running",
        interval_s=0.02,
    )
    steps = scheduler_stats(live.redis_url, CLUSTER).num_steps
    eventually(
        lambda: scheduler_stats(live.redis_url, CLUSTER).num_steps >= steps + 10,
        60,
        "ten steps of it",
        interval_s=0.02,
    )
    live.kill_router()
    asker.join(timeout=60)
    assert failures and isinstance(failures[0], openai.APIConnectionError), failures
    again = client.chat.completions.create(
        **body, extra_headers={"X-Request-Id": "report-1", "X-Resume-From": "0"}
    )
    for got, want in zip(again.choices, undisturbed.choices):
        assert got.model_extra["token_ids"] == want.model_extra["token_ids"]
        assert got.message.content == want.message.content
        assert got.finish_reason == want.finish_reason == "length"
    assert again.id == "chatcmpl-report-1" and again.usage.completion_tokens == 2 * MAX_TOKENS


def test_resuming_an_unknown_request_is_a_404(live: LiveMesh) -> None:
    client = live.client()
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(
            **CHAT, extra_headers={"X-Request-Id": "never-seen", "X-Resume-From": "5,5"}
        )
    assert "request 'chatcmpl-never-seen' has no checkpoint to resume from" in info.value.message
