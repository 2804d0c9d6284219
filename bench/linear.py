"""A decoder's linear layers alone, each backend, against the time to read their weights.

    .venv/bin/python -m bench.linear [--rows 1,4,16,64] [--threads N]

SmolLM2-135M's shapes (30 layers of q, k, v, o, gate, up, down, and the 49,152-row LM head:
538 MB of fp32 weights, random), each layer a weight of its own as in the model, so every
call streams its weight from memory as a decode step does. Backends: `F.linear` (MKL),
oneDNN packed once (`mkldnn._reorder_linear_weight` for 64 rows, vLLM-cpu's choice), and
pagemesh's panels (`kernels/cpu_linear.c`). The floor is `torch.sum` over a buffer of the
weights' size: the memory's bandwidth, which a matrix-vector product cannot beat. Medians of
`--reps` passes over all the layers. Writes bench/results/linear.{md,json}.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch.nn import functional as F

from bench.common import write_results
from bench.step_profile import read_ms
from kernels import cpu_linear, cpu_native
from kernels.cpu_features import cpu_features

HIDDEN, INTERMEDIATE, KV, VOCAB, LAYERS = 576, 1536, 192, 49152, 30
SHAPES = [
    (HIDDEN, HIDDEN),
    (KV, HIDDEN),
    (KV, HIDDEN),
    (HIDDEN, HIDDEN),
    (INTERMEDIATE, HIDDEN),
    (INTERMEDIATE, HIDDEN),
    (HIDDEN, INTERMEDIATE),
]


def weights() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(n, k) * 0.02 for _ in range(LAYERS) for n, k in SHAPES] + [
        torch.randn(VOCAB, HIDDEN) * 0.02
    ]


def pass_ms(
    multiply: Callable[[torch.Tensor, int], object],
    shapes: list[tuple[int, int]],
    rows: int,
    reps: int,
) -> float:
    """Median ms of one pass: `multiply(x, i)` for every layer i, x of its input width."""
    inputs = {k: torch.randn(rows, k) for _, k in shapes}

    def one_pass() -> float:
        start = time.perf_counter()
        for i, (_, k) in enumerate(shapes):
            multiply(inputs[k], i)
        return time.perf_counter() - start

    one_pass()
    return 1000 * statistics.median(one_pass() for _ in range(reps))


def panels_variant(
    define: str, panels: list[torch.Tensor], shapes: list[tuple[int, int]]
) -> Callable[[torch.Tensor, int], object]:
    """The panels kernel built with -D`define` as well (same packing)."""
    errors = []
    for arch in cpu_native.NATIVE_ARCH_FLAGS:
        try:
            lib = cpu_native._build("cpu_linear", (*arch, f"-D{define}"))
            break
        except RuntimeError as error:
            errors.append(str(error))
    else:
        raise SystemExit(f"cpu_linear.c with -D{define} does not build: {errors}")
    return lambda x, i: cpu_linear.linear_f32(x, panels[i], shapes[i][0], lib=lib)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,16,64")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--name", default="linear", help="results file name (bench/results/)")
    parser.add_argument(
        "--panels-define",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="also time the panels built with -DNAME=VALUE (cpu_linear.c's "
        "#ifndef tunables, e.g. LONG_X_ROWS=64), in the same run",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    plain = weights()
    shapes = [tuple(w.shape) for w in plain]
    num_bytes = sum(w.numel() * w.element_size() for w in plain)
    floor = read_ms(num_bytes)
    backends: dict[str, Callable[[torch.Tensor, int], object]] = {
        "F.linear": lambda x, i: F.linear(x, plain[i])
    }
    if cpu_features().onednn_fp32_linear:
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in plain]
        backends["oneDNN packed"] = lambda x, i: torch.ops.mkldnn._linear_pointwise(
            x, onednn[i], None, "none", [], ""
        )
    if cpu_native.library("cpu_linear") is not None:
        panels = [cpu_linear.pack_linear_f32(w) for w in plain]
        backends["native panels"] = lambda x, i: cpu_linear.linear_f32(x, panels[i], shapes[i][0])
        for define in args.panels_define:
            backends[f"panels -D{define}"] = panels_variant(define, panels, shapes)
    rows_list = [int(r) for r in args.rows.split(",")]
    results: dict[str, dict[int, float]] = {name: {} for name in backends}
    for rows in rows_list:  # the backends in turn at each size: drifts hit them alike
        for name, fn in backends.items():
            results[name][rows] = pass_ms(fn, shapes, rows, args.reps)
    table = []
    for rows in rows_list:
        flops = 2 * rows * sum(n * k for n, k in shapes)
        table.append(
            [str(rows)]
            + [
                f"{results[name][rows]:.1f} ({flops / results[name][rows] / 1e6:.0f} GFLOP/s, "
                f"{results[name][rows] / floor:.2f}x floor)"
                for name in backends
            ]
        )
    header = (
        f"# SmolLM2-135M's linear layers ({num_bytes / 1e6:.0f} MB fp32), ms per pass; "
        f"the weights read once in {floor:.1f} ms ({num_bytes / floor / 1e6:.1f} GB/s); "
        f"{torch.get_num_threads()} threads; {cpu_features().one_line()}"
    )
    write_results(
        args.name,
        header,
        ["rows", *backends],
        table,
        {
            "weight_bytes": num_bytes,
            "read_ms": floor,
            "ms": results,
            "cpu": cpu_features().describe(),
        },
    )


if __name__ == "__main__":
    main()
