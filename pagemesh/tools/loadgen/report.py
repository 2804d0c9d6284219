"""Reports of any engine's RunResults: a Markdown table, JSON, and PNG plots.

Nothing here knows who produced a result: `pagemesh bench`, a peer runner (vLLM,
transformers, llama.cpp) or a script all hand in `pagemesh.tools.loadgen.result.RunResult`s.

Files written by `write_report(results, out_dir, name, ...)`:
- `<name>.md`: title, header lines and the table;
- `<name>.json`: `{"title", "header", "machine", "runs": [to_json() + {"summary": summary()}]}`;
  `load_results` (or `RunResult.from_json` on each run) reads it back. With `raw_dir`, that
  file goes to `<raw_dir>/<name>.json` and `<name>.json` keeps only each run's `summary()`
  (percentiles, tok/s: a few KB, what a committed result needs);
- `<name>-latency.png`: CDFs of TTFT, ITL and E2E, one line per run with samples;
- `<name>-throughput.png`: output tok/s against concurrency, one line per engine and
  workload that ran at two or more concurrencies (closed loop only).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pagemesh.tools.loadgen.machine import machine_markdown, machine_record
from pagemesh.tools.loadgen.result import RunResult, percentiles

METRICS = (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E"))


def level_label(result: RunResult) -> str:
    """How the run loaded the engine: "16", "all", or "4 req/s" (", <= 16" with a cap)."""
    if result.request_rate:
        cap = f", <= {result.concurrency}" if result.concurrency else ""
        return f"{result.request_rate:g} req/s{cap}"
    return str(result.concurrency) if result.concurrency else "all"


def run_label(result: RunResult) -> str:
    return f"{result.engine} · {result.workload} · {level_label(result)}"


def _number(value: float, digits: int = 1) -> str:
    return "–" if value is None or math.isnan(value) else f"{value:,.{digits}f}"


def _triple(values: list[float]) -> str:
    p = percentiles(values)
    if math.isnan(p["p50"]):
        return "–"
    return " / ".join(_number(p[q]) for q in ("p50", "p90", "p99"))


def pick_baseline(
    results: Sequence[RunResult], row: RunResult, baseline: str | None
) -> RunResult | None:
    """The row `row` is compared with: the first row when `baseline` is None; else the
    `baseline` engine's run of the same workload and load, or failing that its first run of
    the workload, or its first run at all. None when no run has that engine."""
    if baseline is None:
        return results[0] if results else None
    candidates = [r for r in results if r.engine == baseline]
    same_workload = [r for r in candidates if r.workload == row.workload]
    same_level = [
        r
        for r in same_workload
        if (r.concurrency, r.request_rate) == (row.concurrency, row.request_rate)
    ]
    for group in (same_level, same_workload, candidates):
        if group:
            return group[0]
    return None


def markdown_table(results: Sequence[RunResult], baseline: str | None = None) -> str:
    """One row per run; the last column is output tok/s over the baseline row's."""
    if baseline is None:
        against = f"{results[0].engine} @ {level_label(results[0])}" if results else "first row"
    else:
        against = baseline
    columns = [
        "engine",
        "workload",
        "concurrency / rate",
        "output tok/s",
        "req/s",
        "TTFT ms p50 / p90 / p99",
        "ITL ms p50 / p90 / p99",
        "E2E ms p50 / p90 / p99",
        "errors",
        f"vs {against}",
    ]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for result in results:
        base = pick_baseline(results, result, baseline)
        ratio = math.nan
        if base is not None and base.output_tok_s > 0:
            ratio = result.output_tok_s / base.output_tok_s
        cells = [
            result.engine,
            result.workload,
            level_label(result),
            _number(result.output_tok_s),
            _number(result.requests_s, 2),
            *(_triple(getattr(result, name)) for name, _ in METRICS),
            str(result.num_errors),
            "–" if math.isnan(ratio) else f"{ratio:.2f}x",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def notes_lines(results: Sequence[RunResult]) -> list[str]:
    """Each distinct run note once, with the runs it belongs to ("all runs" when shared)."""
    by_note: dict[str, list[RunResult]] = {}
    for result in results:
        if result.notes:
            by_note.setdefault(result.notes, []).append(result)
    lines = []
    for note, runs in by_note.items():
        who = "all runs" if len(runs) == len(results) > 1 else ", ".join(map(run_label, runs))
        lines.append(f"- {who}: {note}")
    return lines


def _finite(value: Any) -> Any:
    """JSON without NaN/Infinity (which strict parsers reject): those become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def results_json(
    results: Sequence[RunResult], title: str = "", header: Sequence[str] = ()
) -> dict[str, Any]:
    """Every run's raw samples and its summary: what `load_results` reads back."""
    runs = [{**r.to_json(), "summary": r.summary()} for r in results]
    return _finite(
        {"title": title, "header": list(header), "machine": machine_record(), "runs": runs}
    )


def summary_json(
    results: Sequence[RunResult], title: str = "", header: Sequence[str] = ()
) -> dict[str, Any]:
    """`results_json` without the raw samples: each run's `summary()` only."""
    return _finite(
        {
            "title": title,
            "header": list(header),
            "machine": machine_record(),
            "runs": [r.summary() for r in results],
        }
    )


def write_json(path: Path, data: Any) -> None:
    """One JSON file, indented by one space (diffs stay line-sized), NaN as null."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(data), indent=1, allow_nan=False) + "\n")


def load_results(path: str | Path) -> list[RunResult]:
    """The runs of a `<name>.json` written by `write_report`."""
    data = json.loads(Path(path).read_text())
    return [RunResult.from_json(run) for run in data["runs"]]


def write_report(
    results: Sequence[RunResult],
    out_dir: str | Path,
    name: str,
    title: str = "",
    baseline: str | None = None,
    extra_header_lines: Sequence[str] = (),
    raw_dir: str | Path | None = None,
) -> str:
    """Writes `<name>.md`, `<name>.json` and the PNGs into `out_dir`; returns the Markdown.

    `raw_dir`: where the raw samples go (`<raw_dir>/<name>.json`), `<name>.json` then being
    the summaries only; None: `<name>.json` holds both."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    parts = [f"# {title}", ""] if title else []
    # The measuring process's machine (the client's, where the router runs elsewhere).
    parts += [machine_markdown(), ""]
    if extra_header_lines:
        parts += [*extra_header_lines, ""]
    parts.append(markdown_table(results, baseline))
    notes = notes_lines(results)
    if notes:
        parts += ["", *notes]
    markdown = "\n".join(parts) + "\n"
    (out / f"{name}.md").write_text(markdown)
    raw = results_json(results, title, extra_header_lines)
    if raw_dir is None:
        write_json(out / f"{name}.json", raw)
    else:
        write_json(Path(raw_dir) / f"{name}.json", raw)
        write_json(out / f"{name}.json", summary_json(results, title, extra_header_lines))
    write_plots(results, out, name, title)
    return markdown


def sweep_groups(results: Sequence[RunResult]) -> dict[tuple[str, str], list[RunResult]]:
    """Closed-loop runs by (engine, workload), for those that ran at >= 2 concurrencies;
    each group sorted by concurrency ("all" = its number of requests)."""
    groups: dict[tuple[str, str], list[RunResult]] = {}
    for result in results:
        if not result.request_rate:
            groups.setdefault((result.engine, result.workload), []).append(result)
    return {
        key: sorted(runs, key=_in_flight)
        for key, runs in groups.items()
        if len({_in_flight(r) for r in runs}) >= 2
    }


def _in_flight(result: RunResult) -> int:
    return result.concurrency or result.num_requests + result.num_errors


def write_plots(
    results: Sequence[RunResult], out_dir: Path, name: str, title: str = ""
) -> list[Path]:
    """The latency CDFs, and the throughput curve when a sweep ran; the paths written."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on benchmark machines
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    for stale in ("latency", "throughput"):  # a previous run's, under the same name
        (out_dir / f"{name}-{stale}.png").unlink(missing_ok=True)
    written = []
    with_samples = [r for r in results if r.ttft_ms or r.itl_ms or r.e2e_ms]
    if with_samples:
        fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
        for ax, (field, label) in zip(axes, METRICS):
            for result in with_samples:
                values = sorted(getattr(result, field))
                if values:
                    fractions = [(i + 1) / len(values) for i in range(len(values))]
                    ax.step(values, fractions, where="post", label=run_label(result))
            ax.set(xlabel=f"{label} (ms)", ylabel="fraction of samples", title=f"{label} CDF")
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize="small")
        if title:
            fig.suptitle(title)
        fig.tight_layout()
        written.append(_save(fig, out_dir / f"{name}-latency.png"))
    groups = sweep_groups(results)
    if groups:
        fig, ax = plt.subplots(figsize=(7, 4.8))
        for (engine, workload), runs in groups.items():
            ax.plot(
                [_in_flight(r) for r in runs],
                [r.output_tok_s for r in runs],
                marker="o",
                label=f"{engine} · {workload}",
            )
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({_in_flight(r) for runs in groups.values() for r in runs}))
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set(
            xlabel="requests in flight (concurrency)",
            ylabel="output tokens/s",
            title=title or "throughput vs concurrency",
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        written.append(_save(fig, out_dir / f"{name}-throughput.png"))
    return written


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
