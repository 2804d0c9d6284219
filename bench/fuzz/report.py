"""The fuzz run's tables (printed, and written as Markdown) and its JSON summary."""

from __future__ import annotations

import json
import statistics
from collections import Counter
from pathlib import Path

from bench.fuzz import outcomes as oc
from bench.fuzz.run import FuzzResult
from pagemesh.tools.loadgen.machine import machine_markdown, machine_record

EXAMPLES_PER_CELL = 3  # failures quoted per (kind, class), in the Markdown and the JSON


def counts(result: FuzzResult) -> dict[str, Counter]:
    """Per kind (and "total"), how many requests ended in each class."""
    table: dict[str, Counter] = {}
    for outcome in result.outcomes:
        table.setdefault(outcome.kind, Counter())[outcome.result] += 1
    table["total"] = sum(table.values(), Counter())
    return table


def checks(result: FuzzResult) -> list[tuple[str, str, bool]]:
    """(check, what was found, passed)."""
    rows = []
    died = ", ".join(
        f"{p.kind} {p.service_id} (pid {p.pid}) at {at:.0f} s" for p, at in result.died
    )
    rows.append(
        (
            "service processes that died",
            f"{len(result.died)} ({result.num_processes} at the start; "
            "a restarted one is watched too)" + (f": {died}" if died else ""),
            not result.died,
        )
    )
    total = sum(s.num_blocks for s in result.final_stats)
    settled = (
        f"quiet {result.settled_after_s:.1f} s after the last request"
        if result.settled_after_s is not None
        else "not quiet within the settle time: "
        + "; ".join(
            f"{s.group}: {s.num_running} running, {s.num_waiting} waiting"
            for s in result.final_stats
        )
    )
    rows.append(
        (
            "KV blocks held afterwards",
            f"{result.blocks_leaked:,} of {total:,} ({settled})",
            not result.blocks_leaked and result.settled_after_s is not None,
        )
    )
    for good in result.good:
        latency = sorted(good.latencies_s)
        figures = (
            f"p50 {1000 * statistics.median(latency):.0f} ms, max {latency[-1]:.2f} s"
            if latency
            else "no request"
        )
        failures = f"; first: {good.failures[0]}" if good.failures else ""
        rows.append(
            (
                f"good {good.transport} client",
                f"{good.num_requests:,} requests, {good.num_failures} failed ({figures}){failures}",
                good.num_requests > 0 and not good.num_failures,
            )
        )
    if result.config.audit and not result.audit:
        rows.append(
            (
                "left mid-stream",
                "not measured: the mesh was not quiet, or the router not serving, after the run",
                False,
            )
        )
    for row in result.audit:
        freed = (
            f"freed {row.freed_after_s:.2f} s after it left"
            if row.freed_after_s is not None
            else f"still held {row.limit_s:g} s after it left"
        )
        if not row.left:
            freed = "the client could not leave mid-stream"
        rows.append(
            (
                f"left mid-stream: {row.what}",
                f"{freed} (limit {row.limit_s:.1f} s; {row.result})",
                row.passed,
            )
        )
    return rows


def markdown(result: FuzzResult, command: str, machine: dict) -> str:
    config = result.config
    table = counts(result)
    classes = [c for c in oc.CLASSES if table["total"][c] or c in oc.FINE]
    failed = ", ".join(f"{n} {c}" for c, n in table["total"].items() if c in oc.FAILURES)
    lines = [
        "# Hostile input by volume: `bench/fuzz`",
        "",
        f"`{command}`: {len(result.outcomes):,} requests from seed {config.seed}, "
        f"{config.concurrency} probes in flight, against a mesh serving `{result.facts.name}` "
        f"(vocabulary {result.facts.vocab_size}, context {result.facts.max_model_len}); "
        f"{result.wall_s:.0f} s.",
        "",
        machine_markdown(machine),
        "",
        f"**{'PASSED' if result.passed else 'FAILED'}**: {len(result.failures)} requests failed "
        f"({failed or 'none'}).",
        "",
        "| kind | requests | " + " | ".join(classes) + " |",
        "|---|---|" + "---|" * len(classes),
    ]
    for kind, row in table.items():
        lines.append(
            f"| {kind} | {sum(row.values()):,} | "
            + " | ".join(f"{row[c]:,}" for c in classes)
            + " |"
        )
    lines += ["", "| check | found | |", "|---|---|---|"]
    lines += [
        f"| {check} | {found} | {'ok' if passed else '**FAILED**'} |"
        for check, found, passed in checks(result)
    ]
    examples = _examples(result)
    if examples:
        lines += [
            "",
            f"Failures (the first {EXAMPLES_PER_CELL} of each kind and class; `--only INDEX` sends "
            "one again):",
            "",
            "| kind | index | class | detail |",
            "|---|---|---|---|",
        ]
        lines += [f"| {o.kind} | {o.index} | {o.result} | {_cell(o.detail)} |" for o in examples]
    return "\n".join(lines) + "\n"


def summary(result: FuzzResult, command: str, machine: dict) -> dict:
    return {
        "machine": machine,
        "command": command,
        "config": {k: v for k, v in vars(result.config).items()},
        "model": vars(result.facts),
        "passed": result.passed,
        "wall_s": round(result.wall_s, 1),
        "num_requests": len(result.outcomes),
        "counts": {kind: dict(row) for kind, row in counts(result).items()},
        "checks": [{"check": c, "found": f, "passed": p} for c, f, p in checks(result)],
        "failure_examples": [vars(o) for o in _examples(result)],
    }


def write(result: FuzzResult, results_dir: Path, name: str, command: str) -> str:
    """Prints the tables and writes `<name>.md` and `<name>.json` under `results_dir`."""
    machine = machine_record()
    text = markdown(result, command, machine)
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / f"{name}.md").write_text(text)
    (results_dir / f"{name}.json").write_text(
        json.dumps(summary(result, command, machine), indent=2) + "\n"
    )
    print(text)
    return text


def _examples(result: FuzzResult) -> list[oc.Outcome]:
    seen: Counter = Counter()
    chosen = []
    for outcome in result.failures:
        key = (outcome.kind, outcome.result)
        if seen[key] < EXAMPLES_PER_CELL:
            seen[key] += 1
            chosen.append(outcome)
    return chosen


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
