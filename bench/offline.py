"""`pagemesh.LLM.generate` (vLLM's offline API) against the engine core it runs on
(bench/inprocess.py), on the W64 workload, in one process and one run.

    .venv/bin/python -m bench.offline [--dtype float32] [--num-requests 64] [--prompt-len 128]
                                      [--max-tokens 128] [--rounds 3]

Both: the same model and prompts, greedy, EOS ignored, every request at once, the same KV
cache size (the core's, sized as `pagemesh up` sizes it), no swap space. The rounds
alternate core, LLM, core, LLM, ... so that a drift in the machine's speed reaches both, and
each round starts with an empty prefix cache (every round computes every prompt). What
LLM.generate adds to the core is its request pipeline: validation, seeding, the
scheduler's request conversion, and per-token detokenization with stop-string checks on
the engine thread. Writes bench/results/offline.{md,json}.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.common import add_w64_workload_args, w64_workload, write_results
from bench.inprocess import build_engine, run_requests


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_w64_workload_args(parser)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=3, help="measured runs of each engine")
    parser.add_argument("--name", default="offline", help="bench/results/<name>.{md,json}")
    args = parser.parse_args(argv)
    model, prompts = w64_workload(args)

    from pagemesh import LLM, SamplingParams

    scheduler, runner = build_engine(model, args.dtype)
    info = runner.info()
    llm = LLM(
        model,
        dtype=args.dtype,
        kv_cache_memory_gib=info.kv_cache_bytes / (1 << 30),
        swap_space=0,
        seed=0,
    )
    assert llm.num_kv_blocks == info.num_blocks, (llm.num_kv_blocks, info.num_blocks)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)

    # Warm-up, as bench/inprocess.py warms its core.
    run_requests(scheduler, runner, [p[:8] for p in prompts[:4]], 4, workload="warm-up")
    llm.generate(
        [p[:8] for p in prompts[:4]],
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
        use_tqdm=False,
    )
    core_tok_s: list[float] = []
    llm_tok_s: list[float] = []
    num_tokens = len(prompts) * args.max_tokens
    for round_index in range(args.rounds):
        scheduler.reset_prefix_cache()
        core = run_requests(scheduler, runner, prompts, args.max_tokens)
        assert core.output_tokens == num_tokens
        core_tok_s.append(core.output_tok_s)
        llm.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        duration_s = time.perf_counter() - start
        assert sum(len(o.outputs[0].token_ids) for o in outputs) == num_tokens
        llm_tok_s.append(num_tokens / duration_s)
        print(
            f"round {round_index}: core {core_tok_s[-1]:.1f} tok/s, "
            f"LLM.generate {llm_tok_s[-1]:.1f} tok/s"
        )
    llm.close()

    core_median, llm_median = statistics.median(core_tok_s), statistics.median(llm_tok_s)
    workload = (
        f"W64 workload: {len(prompts)} requests x {args.prompt_len} prompt ids x "
        f"{args.max_tokens} new tokens, all at once, greedy, EOS ignored, {args.dtype}, "
        f"{info.num_blocks} KV blocks; {args.rounds} alternating rounds, each from an "
        "empty prefix cache"
    )
    rows = [
        [
            "engine core in-process (`bench/inprocess.py`)",
            ", ".join(f"{v:,.0f}" for v in core_tok_s),
            f"{core_median:,.0f}",
            "1.00",
        ],
        [
            "`pagemesh.LLM.generate`",
            ", ".join(f"{v:,.0f}" for v in llm_tok_s),
            f"{llm_median:,.0f}",
            f"{llm_median / core_median:.2f}",
        ],
    ]
    write_results(
        args.name,
        f"`LLM.generate` against its engine core (`python -m bench.offline`). {workload}.",
        ["engine", "tok/s per round", "median tok/s", "x core"],
        rows,
        {
            "workload": workload,
            "core_tok_s": core_tok_s,
            "llm_tok_s": llm_tok_s,
            "core_median_tok_s": core_median,
            "llm_median_tok_s": llm_median,
            "ratio": llm_median / core_median,
            "argv": {k: v for k, v in vars(args).items()},
        },
    )


if __name__ == "__main__":
    main()
