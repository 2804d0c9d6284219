"""Re-forming an engine group's process group: real processes, real gloo, real Redis.

The first tests drive bare `DistributedContext`s in spawned processes: a group re-forms on
a new port and on the same one (rank 0 survives and its published address is reused), a
SIGKILLed or frozen peer fails the survivor's collective within a bounded time, a join is
called off or times out. The last test runs `python -m worker_svc.main` workers (tp=2)
against Redis, playing the scheduler: it publishes rendezvous plans, kills a worker, and
lets a --standby worker take its place, sending real steps to check each formation.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis

from pagemesh.runtime.internal_auth import token_metadata
from pagemesh.runtime.ports import reserve_port
from pagemesh.tools.testing.tiny_models import write_tiny_model
from protos.pagemesh.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.support.eventually import eventually
from tests.support.parallel_harness import CommRank
from tests.support.paths import REPO_ROOT
from worker_svc.parallel import ParallelConfig

pytestmark = pytest.mark.timeout(180)

TP2 = [ParallelConfig(tp_size=2, tp_rank=0), ParallelConfig(tp_size=2, tp_rank=1)]


@pytest.fixture
def spawn() -> Iterator[Callable[[int], list[CommRank]]]:
    created: list[CommRank] = []

    def start(count: int) -> list[CommRank]:
        ranks = [CommRank() for _ in range(count)]
        created.extend(ranks)
        return ranks

    yield start
    for rank in created:
        rank.close()


def all_reduce(ranks: list[CommRank], values: list[float]) -> list[list[float]]:
    for rank, value in zip(ranks, values, strict=True):
        rank.all_reduce(value)
    return [rank.answer_ok() for rank in ranks]


def test_group_reforms_on_a_new_port_then_on_the_same_one(spawn) -> None:
    ranks = spawn(2)
    port = reserve_port()
    for rank, parallel in zip(ranks, TP2):
        rank.init(parallel, port, tag="e1")
    assert [rank.answer_ok() for rank in ranks] == [None, None]
    assert all_reduce(ranks, [1, 2]) == [[3.0] * 4] * 2

    new_port = reserve_port()
    for rank in ranks:
        rank.reform(new_port, tag="e2")
    assert [rank.answer_ok() for rank in ranks] == [None, None]
    assert all_reduce(ranks, [3, 4]) == [[7.0] * 4] * 2

    # Rank 0 survived, so the next plan names its address again. Rank 1 gets there first,
    # while rank 0's store of epoch e2 still listens on the port: it must wait for the
    # store of e3 instead of counting itself in the old one.
    ranks[1].reform(new_port, tag="e3")
    time.sleep(1.0)
    ranks[0].reform(new_port, tag="e3")
    assert [rank.answer_ok() for rank in ranks] == [None, None]
    assert all_reduce(ranks, [5, 6]) == [[11.0] * 4] * 2


@pytest.mark.parametrize("victim", [0, 1], ids=["rank0-hosting-the-store", "rank1"])
def test_a_killed_peer_fails_the_collective_and_the_survivor_reforms_with_a_new_one(
    spawn, victim: int
) -> None:
    ranks = spawn(2)
    port = reserve_port()
    for rank, parallel in zip(ranks, TP2):
        rank.init(parallel, port, tag="e1", timeout_s=10.0)
    [rank.answer_ok() for rank in ranks]
    survivor = ranks[1 - victim]
    survivor.all_reduce(1.0)  # waits for the victim, which never joins this one
    time.sleep(0.5)
    ranks[victim].kill()
    answer = survivor.answer(timeout_s=20)
    assert answer.error_type == "GroupCommError", answer
    assert "connection closed by peer" in answer.message.lower()  # gloo's words
    waited_s = answer.value[1] - 0.5
    assert waited_s < 5.0, f"the collective took {waited_s:.1f} s to fail"

    (fresh,) = spawn(1)
    new_port = reserve_port()
    survivor.reform(new_port, tag="e2", timeout_s=30.0)
    fresh.init(TP2[victim], new_port, tag="e2", timeout_s=30.0)
    assert survivor.answer_ok() is None and fresh.answer_ok() is None
    values = {victim: 10.0, 1 - victim: 1.0}
    group = {victim: fresh, 1 - victim: survivor}
    assert all_reduce([group[0], group[1]], [values[0], values[1]]) == [[11.0] * 4] * 2


def test_a_frozen_peer_fails_the_collective_after_the_group_timeout(spawn) -> None:
    ranks = spawn(2)
    port = reserve_port()
    for rank, parallel in zip(ranks, TP2):
        rank.init(parallel, port, tag="e1", timeout_s=3.0)
    [rank.answer_ok() for rank in ranks]
    os.kill(ranks[1].process.pid, signal.SIGSTOP)  # alive, sockets open, never answers
    try:
        ranks[0].all_reduce(1.0)
        answer = ranks[0].answer(timeout_s=20)
    finally:
        ranks[1].kill()
    assert answer.error_type == "GroupCommError", answer
    assert "timed out" in answer.message.lower(), answer
    assert 2.5 < answer.value[1] < 10.0


def test_a_rank_abandons_a_collective_on_a_frozen_peer_and_reforms_at_once(spawn) -> None:
    """The scheduler declared the frozen peer failed: the survivor is told to leave (as its
    servicer does on a new plan). Its collective ends at once, not at the group's timeout,
    and it re-forms on the same port with a replacement while the frozen one still holds
    its sockets open."""
    survivor, frozen, replacement = spawn(3)
    port = reserve_port()
    for rank, parallel in zip((survivor, frozen), TP2):
        rank.init(parallel, port, tag="e1", timeout_s=60.0)
    [rank.answer_ok() for rank in (survivor, frozen)]
    os.kill(frozen.process.pid, signal.SIGSTOP)
    try:
        survivor.all_reduce(1.0, abandon_after_s=0.5)
        answer = survivor.answer(timeout_s=20)
        assert answer.error_type == "GroupAbandoned", answer
        assert answer.value[1] < 2.0, answer  # 0.5 s + one wait slice, not 60 s
        survivor.reform(port, tag="e2", timeout_s=20.0)
        replacement.init(TP2[1], port, tag="e2", timeout_s=20.0)
        assert survivor.answer_ok() is None and replacement.answer_ok() is None
        assert all_reduce([survivor, replacement], [2, 5]) == [[7.0] * 4] * 2
    finally:
        frozen.kill()


def test_a_join_is_called_off_or_times_out_and_the_port_is_free_again(spawn) -> None:
    host, client = spawn(2)
    port = reserve_port()
    host.init(TP2[0], port, tag="e1", abort_after_s=1.0)  # its peer never comes
    client.init(TP2[1], reserve_port(), tag="e1", timeout_s=1.5)  # nobody listens there
    for rank, error in ((host, "JoinAborted"), (client, "TimeoutError")):
        answer = rank.answer(timeout_s=20)
        assert answer.error_type == error, answer
        assert answer.value[1] < 5.0
    # The called-off host closed its store: the next formation gets the port.
    client.init(TP2[1], port, tag="e2")
    host.init(TP2[0], port, tag="e2")
    assert host.answer_ok() is None and client.answer_ok() is None
    assert all_reduce([host, client], [2, 5]) == [[7.0] * 4] * 2


# --- real worker processes --------------------------------------------------------------


class Workers:
    """`python -m worker_svc.main` processes of one group, and the Redis they register in."""

    def __init__(self, redis_url: str, model: Path, log_dir: Path) -> None:
        self.redis_url = redis_url
        self.cluster = f"reform-{uuid.uuid4().hex[:8]}"
        self.model = model
        self.log_dir = log_dir
        self.redis = redis.Redis.from_url(redis_url, decode_responses=True)
        self.processes: dict[str, subprocess.Popen] = {}

    def start(self, worker_id: str, *flags: str) -> None:
        command = [
            sys.executable,
            "-m",
            "worker_svc.main",
            "--redis-url",
            self.redis_url,
            "--cluster",
            self.cluster,
            "--group",
            "g0",
            "--worker-id",
            worker_id,
            "--model",
            str(self.model),
            "--tp",
            "2",
            "--torch-threads",
            "1",
            "--num-kv-blocks",
            "32",
            "--swap-space",
            "0",
            "--dist-timeout-s",
            "30",
            "--heartbeat-interval-s",
            "0.5",
            "--heartbeat-ttl-s",
            "2",
            *flags,
        ]
        with open(self.log_dir / f"{worker_id}.log", "wb") as log:
            self.processes[worker_id] = subprocess.Popen(
                command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT
            )

    def log(self, worker_id: str) -> str:
        return (self.log_dir / f"{worker_id}.log").read_text(errors="replace")

    def entry(self, worker_id: str) -> dict[str, Any]:
        raw = self.redis.get(f"{self.cluster}:worker:{worker_id}")
        return json.loads(raw) if raw else {}

    def wait_for(self, worker_id: str, timeout_s: float = 60.0, **expected: Any) -> dict:
        def reached() -> dict | None:
            entry = self.entry(worker_id)
            if all(entry.get(key) == value for key, value in expected.items()):
                return entry
            assert self.processes[worker_id].poll() is None, (
                f"{worker_id} exited:\n{self.log(worker_id)}"
            )
            return None

        return eventually(
            reached,
            timeout_s,
            lambda: (
                f"{worker_id} never reached {expected}: "
                f"{self.entry(worker_id)}\n{self.log(worker_id)}"
            ),
        )

    def wait_for_log(self, worker_id: str, text: str, timeout_s: float = 30.0) -> None:
        eventually(
            lambda: text in self.log(worker_id),
            timeout_s,
            f"{worker_id} never logged {text!r}",
            interval_s=0.05,
        )

    def publish_plan(
        self, epoch: str, members: dict[str, int], master_addr: str | None = None
    ) -> None:
        """Rank 0's published `dist_addr` is the master address, unless given."""
        if master_addr is None:
            master = next(wid for wid, rank in members.items() if rank == 0)
            master_addr = self.entry(master)["dist_addr"]
        host, port = master_addr.rsplit(":", 1)
        plan = {
            "epoch": epoch,
            "world_size": 2,
            "master_addr": host,
            "master_port": int(port),
            "members": members,
        }
        self.redis.set(f"{self.cluster}:rendezvous:g0", json.dumps(plan))

    def stub(self, worker_id: str) -> worker_pb2_grpc.WorkerStub:
        channel = grpc.insecure_channel(self.entry(worker_id)["address"])
        return worker_pb2_grpc.WorkerStub(channel)

    def drive(self, session: str, epoch: str | None = None, group: str = "g0") -> None:
        """Registers a scheduler of `group` driving `session` in `epoch` (by default the one
        w0 is in), as a scheduler does before a session's first step."""
        if epoch is None:
            epoch = self.entry("w0").get("epoch", "")
        entry = {
            "address": "127.0.0.1:1",
            "group": group,
            "session": session,
            "epoch": epoch,
            "instance": f"scheduler-{session}",
        }
        self.redis.set(f"{self.cluster}:scheduler:{group}", json.dumps(entry), px=60_000)

    def step(
        self, worker_ids: list[str], request: worker_pb2.ExecuteStepRequest, drive: bool = True
    ) -> list[Any]:
        """The same step to every worker at once: each response, or the RpcError raised. A
        session's first step is announced first (`drive`) unless told not to."""
        if drive and request.sequence == 0:
            self.drive(request.session_id)
        futures = [
            self.stub(wid).ExecuteStep.future(request, timeout=30, metadata=token_metadata())
            for wid in worker_ids
        ]
        results = []
        for future in futures:
            try:
                results.append(future.result())
            except grpc.RpcError as error:
                results.append(error)
        return results

    def close(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
        self.redis.close()


PROMPT = [5, 9, 33, 2, 70, 11]
GREEDY = worker_pb2.SamplingParams(temperature=0.0, top_p=1.0, repetition_penalty=1.0)


def prefill(session: str) -> worker_pb2.ExecuteStepRequest:
    new = worker_pb2.NewRequest(
        request_id="r1",
        token_ids=PROMPT,
        num_prompt_tokens=len(PROMPT),
        block_ids=[0],
        num_computed_tokens=0,
        sampling=GREEDY,
    )
    return worker_pb2.ExecuteStepRequest(
        step_id=1,
        new_requests=[new],
        session_id=session,
        sequence=0,
        num_scheduled_tokens={"r1": len(PROMPT)},
    )


def decode(session: str, sequence: int, token_id: int) -> worker_pb2.ExecuteStepRequest:
    cached = worker_pb2.CachedRequest(
        request_id="r1", num_computed_tokens=len(PROMPT), new_token_ids=[token_id]
    )
    return worker_pb2.ExecuteStepRequest(
        step_id=sequence + 1,
        cached_requests=[cached],
        session_id=session,
        sequence=sequence,
        num_scheduled_tokens={"r1": 1},
    )


def sampled_token(responses: list[Any]) -> int:
    """The driver's (tp rank 0, listed first) token, after checking every rank succeeded."""
    for response in responses:
        assert isinstance(response, worker_pb2.ExecuteStepResponse), response
    (token,) = responses[0].sampled
    return token.token_id


@pytest.fixture
def workers(tmp_path: Path, redis_url: str) -> Iterator[Workers]:
    model = write_tiny_model(tmp_path / "model", "llama")
    group = Workers(redis_url, model, tmp_path)
    yield group
    group.close()


def test_workers_reform_without_reloading_and_a_standby_takes_a_dead_ones_place(
    workers: Workers,
) -> None:
    workers.start("w0", "--tp-rank", "0")
    workers.start("w1", "--tp-rank", "1")
    workers.start("spare", "--standby", "--tp-rank", "1")  # the rank flag is ignored
    workers.wait_for("w0", status="joining")
    workers.wait_for("w1", status="joining")
    workers.wait_for("spare", status="standby", tp_rank=-1, pp_rank=-1, tp_size=2)

    workers.publish_plan("e1", {"w0": 0, "w1": 1})
    workers.wait_for("w0", status="ready", epoch="e1")
    workers.wait_for("w1", status="ready", epoch="e1")
    token = sampled_token(workers.step(["w0", "w1"], prefill("s1")))
    sampled_token(workers.step(["w0", "w1"], decode("s1", 1, token)))

    # Only the group's registered scheduler starts a session: not one nobody registered, not
    # one registered for another epoch or for another group (all refused at once, together).
    workers.drive("x-epoch", epoch="e0")
    workers.drive("x-group", epoch="e1", group="g1")
    refused = [
        workers.stub("w0").ExecuteStep.future(
            prefill(session), timeout=30, metadata=token_metadata()
        )
        for session in ("x-epoch", "x-group", "x-nobody")
    ]
    for future in refused:
        error = future.exception()
        assert error is not None and error.code() == grpc.StatusCode.PERMISSION_DENIED, error
        assert "only the group's current scheduler may drive this worker" in error.details()
    assert "x-epoch" in refused[2].exception().details()  # names what is registered

    # Same members, new epoch: both re-form in place; rank 0's address (port) is reused.
    workers.publish_plan("e2", {"w0": 0, "w1": 1})
    for worker_id in ("w0", "w1"):
        workers.wait_for(worker_id, timeout_s=30, status="ready", epoch="e2", num_reforms=1)
    # Each starts afresh, as a replacement would: no request state, steps from sequence 0.
    for error in workers.step(["w0", "w1"], decode("s2", 0, token)):
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error
    # A new scheduler session alone also drops the old session's requests.
    assert sampled_token(workers.step(["w0", "w1"], prefill("s3"))) == token
    for error in workers.step(["w0", "w1"], decode("s4", 0, token)):
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error

    # A step that w1 never gets blocks w0 until w1 leaves the old group to re-form: the step
    # fails, then w0 re-forms too.
    workers.drive("s5")
    blocked = workers.stub("w0").ExecuteStep.future(
        prefill("s5"), timeout=30, metadata=token_metadata()
    )
    workers.wait_for_log("w0", "new scheduler session s5")  # handed to the model thread
    time.sleep(0.2)
    workers.publish_plan("e2b", {"w0": 0, "w1": 1})
    assert blocked.exception().code() == grpc.StatusCode.ABORTED, blocked.exception()
    for worker_id in ("w0", "w1"):
        workers.wait_for(worker_id, timeout_s=30, status="ready", epoch="e2b", num_reforms=2)

    # A restarted Redis loses the plan: no change for the workers.
    workers.redis.delete(f"{workers.cluster}:rendezvous:g0")
    time.sleep(1.0)
    assert workers.entry("w0")["status"] == "ready" and workers.entry("w0")["epoch"] == "e2b"

    # w1 dies in the middle of a step: w0's step fails at once, not after the group timeout.
    workers.drive("s6")
    blocked = workers.stub("w0").ExecuteStep.future(
        prefill("s6"), timeout=30, metadata=token_metadata()
    )
    workers.wait_for_log("w0", "new scheduler session s6")
    time.sleep(0.2)
    w1_dist_addr = workers.entry("w1")["dist_addr"]
    killed_s = time.monotonic()
    workers.processes["w1"].kill()
    assert blocked.exception().code() == grpc.StatusCode.ABORTED, blocked.exception()
    assert "closed by peer" in blocked.exception().details()
    assert time.monotonic() - killed_s < 5.0
    # A plan still naming w1 leaves w0 waiting for it, refusing steps meanwhile...
    workers.publish_plan("e3", {"w0": 0, "w1": 1})
    workers.wait_for("w0", status="joining", epoch="")
    (refused,) = workers.step(["w0"], prefill("s7"))
    assert refused.code() == grpc.StatusCode.UNAVAILABLE, refused
    assert "re-forming" in refused.details()
    # A plan that leaves w0 out calls off its join too. The standby follows that plan, but
    # its rank 0 (w1) is dead...
    workers.publish_plan("e3b", {"w1": 0, "spare": 1}, master_addr=w1_dist_addr)
    workers.wait_for("spare", status="joining", tp_rank=1, pp_rank=0)
    # ... until the next plan, with the standby in w1's place, supersedes both.
    workers.publish_plan("e4", {"w0": 0, "spare": 1})
    spare = workers.wait_for("spare", status="ready", epoch="e4")
    assert (spare["tp_rank"], spare["pp_rank"]) == (1, 0)
    workers.wait_for("w0", status="ready", epoch="e4", num_reforms=3)
    assert sampled_token(workers.step(["w0", "spare"], prefill("s8"))) == token

    # w0 loaded its weights once, whatever the re-formations.
    assert workers.log("w0").count("KV cache:") == 1
    assert "epoch e3 failed (JoinAborted" in workers.log("w0")
    assert "joining group g0 epoch e3b" not in workers.log("w0")
    assert "epoch e3b failed (JoinAborted" in workers.log("spare")
    assert workers.log("spare").count("KV cache:") == 1
