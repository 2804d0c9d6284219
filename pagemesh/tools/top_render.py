"""Rich tables of a `Snapshot`: printed once by `pagemesh top --once`, shown live by the TUI."""

from __future__ import annotations

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from pagemesh.runtime.registry_entries import GroupStatus, WorkerStatus
from pagemesh.tools.top_snapshot import Rates, Snapshot

# Groups' and workers' statuses (both "ready" are green); any other, "no scheduler" too, red.
_STATUS_STYLES = {
    GroupStatus.READY: "green",
    GroupStatus.DEGRADED: "yellow",
    GroupStatus.DRAINING: "cyan",
    WorkerStatus.JOINING: "cyan",
    WorkerStatus.STANDBY: "blue",
}


def _status(status: str) -> Text:
    return Text(status, style=_STATUS_STYLES.get(status, "red"))


def fmt_rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def fmt_percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100.0 * fraction:.1f}%"


def fmt_latency(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.1f} ms" if seconds < 1.0 else f"{seconds:.2f} s"


def fmt_bytes(num_bytes: int | None) -> str:
    """Binary units, 3 significant digits: 812M, 1.25G."""
    if num_bytes is None:
        return "-"
    value, unit = float(num_bytes), "B"
    for unit in ("B", "K", "M", "G", "T"):
        if value < 1000 or unit == "T":
            break
        value /= 1024
    return f"{value:.0f}{unit}" if value >= 100 or unit == "B" else f"{value:.3g}{unit}"


def fmt_age(seconds: float | None) -> Text:
    if seconds is None:
        return Text("-")
    return Text(f"{seconds:.1f}s", style="red" if seconds > 2.0 else "")


def _metrics(state: str) -> Text:
    return Text(state, style={"ok": "green", "-": "dim"}.get(state, "red"))


def _table(title: str) -> Table:
    # No vertical rules: a 14-column table still fits a 120-column terminal.
    return Table(
        title=title,
        title_justify="left",
        title_style="bold",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        collapse_padding=True,
    )


def summary_table(snapshot: Snapshot, rates: Rates, cluster: str) -> Table:
    """One line for the whole cluster: who is up and how fast tokens flow."""
    window = (
        "latencies since start"
        if rates.window_s is None
        else f"rates and latencies over the last {rates.window_s:.1f}s"
    )
    table = _table(f"pagemesh cluster {cluster!r} ({window})")
    ready = sum(1 for g in snapshot.groups if g.status == GroupStatus.READY)
    in_flight = [r.num_in_flight for r in snapshot.routers if r.num_in_flight is not None]
    for column in (
        "routers",
        "groups ready",
        "workers ready",
        "in flight",
        "out tok/s",
        "prompt tok/s",
        "req/s",
        "TTFT p50",
        "ITL p50",
        "E2E p50",
    ):
        table.add_column(column, justify="right", no_wrap=True)
    table.add_row(
        str(len(snapshot.routers)),
        f"{ready}/{len(snapshot.groups)}",
        f"{sum(1 for w in snapshot.workers if w.status == WorkerStatus.READY)}"
        f"/{len(snapshot.workers)}",
        str(sum(in_flight)) if in_flight else "-",
        fmt_rate(rates.output_tokens_per_s),
        fmt_rate(rates.prompt_tokens_per_s),
        fmt_rate(rates.requests_per_s),
        fmt_latency(rates.ttft_p50_s),
        fmt_latency(rates.itl_p50_s),
        fmt_latency(rates.e2e_p50_s),
    )
    return table


def groups_table(snapshot: Snapshot, rates: Rates) -> Table:
    table = _table("engine groups")
    for column in (
        "group",
        "scheduler",
        "status",
        "workers",
        "queue",
        "run",
        "swap",
        "KV",
        "prefix",
        "spec acc",
        "spec len",
        "preempt/s",
        "recov",
        "steps/s",
        "hot experts",
        "hb age",
        "metrics",
    ):
        table.add_column(
            column,
            justify="left"
            if column in ("group", "scheduler", "metrics", "hot experts")
            else "right",
            no_wrap=column != "metrics",
        )
    for row in snapshot.groups:
        key = f"scheduler:{row.scheduler_id}"
        expected = str(row.workers_expected) if row.workers_expected else "?"
        table.add_row(
            row.group,
            row.scheduler_id or "-",
            _status(row.status),
            f"{row.workers_alive}/{expected}",
            str(row.num_waiting),
            str(row.num_running),
            str(row.num_swapped),
            fmt_percent(row.kv_usage),
            fmt_percent(row.prefix_hit_rate),
            fmt_percent(row.spec_acceptance),
            f"{row.spec_mean_length:.2f}" if row.spec_mean_length is not None else "-",
            fmt_rate(rates.preemptions_per_s.get(key)),
            str(row.num_recoveries),
            fmt_rate(rates.steps_per_s.get(key)),
            ", ".join(h.label() for h in rates.hot_experts.get(row.group, ())) or "-",
            fmt_age(row.heartbeat_age_s),
            _metrics(row.metrics),
        )
    return table


def workers_table(snapshot: Snapshot, rates: Rates) -> Table:
    table = _table("workers")
    for column in (
        "worker",
        "group",
        "pp",
        "tp",
        "status",
        "epoch",
        "steps",
        "steps/s",
        "busy",
        "comm",
        "weights",
        "KV",
        "RSS",
        "hb age",
        "metrics",
    ):
        table.add_column(
            column,
            justify="left" if column in ("worker", "group", "epoch", "metrics") else "right",
            no_wrap=column != "metrics",
        )
    for row in snapshot.workers:
        key = f"worker:{row.worker_id}"
        table.add_row(
            row.worker_id,
            row.group,
            _rank(row.pp_rank),
            _rank(row.tp_rank),
            _status(row.status),
            row.epoch[:8] or "-",
            str(row.num_steps),
            fmt_rate(rates.steps_per_s.get(key)),
            fmt_percent(rates.busy_fraction.get(key)),
            fmt_percent(rates.communication_fraction.get(key)),
            fmt_bytes(row.weight_bytes),
            fmt_bytes(row.kv_cache_bytes),
            fmt_bytes(row.rss_bytes),
            fmt_age(row.heartbeat_age_s),
            _metrics(row.metrics),
        )
    return table


def _rank(rank: int) -> str:
    return "-" if rank < 0 else str(rank)


def routers_table(snapshot: Snapshot) -> Table:
    table = _table("routers")
    for column in ("router", "address", "serving", "groups", "in flight", "hb age", "metrics"):
        table.add_column(
            column,
            justify="left" if column in ("router", "address", "metrics") else "right",
            no_wrap=column != "metrics",
        )
    for row in snapshot.routers:
        table.add_row(
            row.router_id,
            row.address,
            Text("yes", style="green") if row.serving else Text("no", style="red"),
            str(row.num_groups),
            "-" if row.num_in_flight is None else str(row.num_in_flight),
            fmt_age(row.heartbeat_age_s),
            _metrics(row.metrics),
        )
    return table


def render(snapshot: Snapshot, rates: Rates, cluster: str) -> Group:
    """Every table of one refresh, top to bottom."""
    return Group(
        summary_table(snapshot, rates, cluster),
        groups_table(snapshot, rates),
        workers_table(snapshot, rates),
        routers_table(snapshot),
    )
