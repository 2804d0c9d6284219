"""Runs the peers of `pagemesh bench` on the model folder and prompts pagemesh was given.

Every peer runs as a subprocess, also transformers (whose venv is ours): a fresh process per
(peer, dtype) keeps torch's thread pools, oneDNN caches and memory from one measurement out of
the next, and lets a hung engine be killed whole (its process group) at a timeout. vLLM and
llama.cpp run under the pythons of their venvs in .peers/ (scripts/install_peers.sh); a peer
whose venv is missing is skipped with the reason printed. A peer that fails or times out yields
one RunResult with num_errors=1 and the reason in `notes`, so reports show the hole.

    python -m bench.peers.suite [--names vllm,llamacpp] [--dtypes float32] [W64 flags]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.peers.vllm_server import PEERS_DIR, vllm_env  # noqa: E402
from pagemesh.tools.loadgen.result import RunResult  # noqa: E402

PEER_NAMES = ("vllm", "transformers", "llamacpp")
VENV_PYTHONS = {
    "vllm": PEERS_DIR / "vllm" / "bin" / "python",
    "llamacpp": PEERS_DIR / "llama" / "bin" / "python",
}
SCRIPTS = {
    "vllm": REPO_ROOT / "bench" / "peers" / "vllm_runner.py",
    "llamacpp": REPO_ROOT / "bench" / "peers" / "llamacpp_runner.py",
}
# vLLM's first start compiles for ~140 s; transformers fp32 one at a time is ~110 s on W64.
TIMEOUTS_S = {"vllm": 1200.0, "transformers": 1200.0, "llamacpp": 900.0}
LOG_DIR = PEERS_DIR / "logs"


@dataclass
class PeerRun:
    """One (peer, dtype) subprocess: its RunResults and the new token ids of each prompt
    (transformers: of its sequential mode when it ran, else of its batched mode)."""

    results: list[RunResult]
    token_ids: list[list[int]]


def available_peers() -> dict[str, str | None]:
    """Peer name -> None when it can run here, else why not."""
    reasons: dict[str, str | None] = {}
    for name, python in VENV_PYTHONS.items():
        reasons[name] = (
            None
            if python.exists()
            else (f"{python} missing: run `make bench-peers` (scripts/install_peers.sh)")
        )
    missing = [m for m in ("transformers", "torch") if importlib.util.find_spec(m) is None]
    reasons["transformers"] = f"{', '.join(missing)} not importable" if missing else None
    return {name: reasons[name] for name in PEER_NAMES}


def peer_command(
    name: str,
    model_dir: str,
    prompts_file: Path,
    dtype: str,
    workload: str,
    extra_args: tuple[str, ...] = (),
) -> list[str]:
    common = [
        "--model",
        str(model_dir),
        "--prompts",
        str(prompts_file),
        "--dtype",
        dtype,
        "--workload",
        workload,
        *extra_args,
    ]
    if name == "transformers":
        return [sys.executable, "-m", "bench.peers.transformers_runner", *common]
    return [str(VENV_PYTHONS[name]), str(SCRIPTS[name]), *common]


def _run_subprocess(
    command: list[str], env: dict[str, str], timeout_s: float, log_path: Path
) -> tuple[int | None, str]:
    """(exit status or None on timeout, stdout); stderr goes to `log_path`. The child leads
    its own process group so a timeout kills its engine processes too."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=log,
            start_new_session=True,
        )
        try:
            stdout, _ = proc.communicate(timeout=timeout_s)
            status: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, _ = proc.communicate()
            status = None
    try:  # engine processes that outlived a finished leader
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return status, stdout.decode(errors="replace")


def _log_tail(log_path: Path, num_lines: int = 12) -> str:
    try:
        return "\n".join(log_path.read_text(errors="replace").splitlines()[-num_lines:])
    except OSError:
        return ""


def run_peer(
    name: str,
    model_dir: str | Path,
    prompts: list[list[int]],
    max_tokens: int,
    dtype: str,
    *,
    workload: str = "w64",
    timeout_s: float | None = None,
    extra_args: tuple[str, ...] = (),
) -> PeerRun:
    """Run one peer on one dtype in a subprocess; raises RuntimeError (with its log's tail)
    when it fails, times out or prints no result."""
    log_path = LOG_DIR / f"{name}-{dtype}-{int(time.time())}.log"
    with tempfile.TemporaryDirectory() as tmp:
        prompts_file = Path(tmp) / "prompts.json"
        prompts_file.write_text(json.dumps({"prompts": prompts, "max_tokens": max_tokens}))
        # Absolute: the peer runs from the repo root, whatever the caller's directory.
        command = peer_command(
            name, str(Path(model_dir).resolve()), prompts_file, dtype, workload, extra_args
        )
        env = vllm_env() if name == "vllm" else dict(os.environ)
        limit_s = timeout_s or TIMEOUTS_S[name]
        status, stdout = _run_subprocess(command, env, limit_s, log_path)
    lines = [line for line in stdout.splitlines() if line.strip()]
    if status != 0 or not lines:
        why = f"timed out after {limit_s:.0f} s" if status is None else f"exit status {status}"
        raise RuntimeError(f"{name} {dtype}: {why}; log {log_path}:\n{_log_tail(log_path)}")
    report = json.loads(lines[-1])
    token_ids = report["token_ids"]
    if isinstance(token_ids, dict):  # transformers: per mode
        token_ids = token_ids.get("sequential") or token_ids.get("batched") or []
    return PeerRun([RunResult.from_json(r) for r in report["results"]], token_ids)


def run_peers(
    model_dir: str,
    prompts: list[list[int]],
    max_tokens: int,
    dtypes: tuple[str, ...] = ("float32", "bfloat16"),
    names: tuple[str, ...] = PEER_NAMES,
    *,
    workload: str = "w64",
    timeouts_s: dict[str, float] | None = None,
) -> list[RunResult]:
    """Every available peer of `names` on every dtype, in that order; skipped peers are
    printed, failed ones become a RunResult with num_errors=1 and the reason in notes."""
    reasons = available_peers()
    results: list[RunResult] = []
    for name in names:
        if name not in reasons:
            raise ValueError(f"unknown peer {name!r}: expected one of {PEER_NAMES}")
        if reasons[name]:
            print(f"peers: skipping {name}: {reasons[name]}", flush=True)
            continue
        for dtype in dtypes:
            print(f"peers: running {name} {dtype} on {len(prompts)} prompts", flush=True)
            try:
                run = run_peer(
                    name,
                    model_dir,
                    prompts,
                    max_tokens,
                    dtype,
                    workload=workload,
                    timeout_s=(timeouts_s or {}).get(name),
                )
                results += run.results
            except RuntimeError as error:
                print(f"peers: {error}", flush=True)
                results.append(
                    RunResult(
                        engine=f"{name} {dtype}",
                        workload=workload,
                        dtype=dtype,
                        concurrency=0,
                        num_requests=len(prompts),
                        prompt_tokens=sum(len(p) for p in prompts),
                        output_tokens=0,
                        duration_s=0.0,
                        num_errors=1,
                        notes=f"failed: {str(error).splitlines()[0]}",
                    )
                )
    return results


def format_results(results: list[RunResult]) -> str:
    """A Markdown table: engine, dtype, output tok/s, TTFT/ITL p50, requests, errors."""
    lines = [
        "| engine | dtype | requests | output tok/s | TTFT p50 ms | ITL p50 ms | errors |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        s = r.summary()
        lines.append(
            f"| {r.engine} | {r.dtype} | {r.num_requests} | {s['output_tok_s']:,.0f} "
            f"| {s['ttft_ms']['p50']:.1f} | {s['itl_ms']['p50']:.1f} "
            f"| {r.num_errors} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from bench.common import add_w64_workload_args, w64_workload

    parser = argparse.ArgumentParser(description="run the peers of pagemesh bench on W64")
    add_w64_workload_args(parser)
    parser.add_argument("--names", default=",".join(PEER_NAMES))
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--json", default=None, help="also write the RunResults here")
    args = parser.parse_args(argv)
    model, prompts = w64_workload(args)
    results = run_peers(
        model, prompts, args.max_tokens, tuple(args.dtypes.split(",")), tuple(args.names.split(","))
    )
    print(format_results(results))
    if args.json:
        Path(args.json).write_text(json.dumps([r.to_json() for r in results]) + "\n")


if __name__ == "__main__":
    main()
