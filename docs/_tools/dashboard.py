"""Draws the Grafana dashboard's panels from scraped /metrics, without Grafana.

Grafana cannot run here, so docs/_tools/screenshots.py hands its scrapes to `draw`, which
evaluates each panel's PromQL with docs/_tools/promql.py and draws the panels on the
dashboard's 24-column grid with matplotlib: time series, stats (the last value, over a
sparkline) and the build-info table.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from docs._tools.promql import Evaluator, Scrape, panel_series, parse


def fmt(value: float, unit: str | None) -> str:
    if unit == "percentunit":
        return f"{value * 100:.1f}%"
    if unit == "s":
        return f"{value * 1000:.0f} ms" if abs(value) < 1 else f"{value:.2f} s"
    suffix = " req/s" if unit == "reqps" else ""
    return (f"{value:.0f}" if abs(value) >= 100 or value == int(value) else f"{value:.2f}") + suffix


def draw(
    dashboard_path: Path,
    scrapes: list[Scrape],
    out_path: Path,
    title: str,
    footer: str,
    rate_interval_s: float,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle
    from matplotlib.ticker import FuncFormatter

    dash = json.loads(dashboard_path.read_text())
    subs = {"$__rate_interval": f"{rate_interval_s:g}s", "$group": ".*"}
    evaluator = Evaluator(scrapes)
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in dash["panels"])
    unit_w, unit_h, top_in, bottom_in = 0.8, 0.3, 0.8, 0.4
    width, height = 24 * unit_w, rows * unit_h + top_in + bottom_in
    bg, panel_bg, fg, muted = "#111217", "#181b1f", "#d8d9da", "#8e8e8e"
    colors = ["#73bf69", "#f2cc0c", "#5794f2", "#ff9830", "#f2495c", "#b877d9", "#8ab8ff"]
    fig = plt.figure(figsize=(width, height), dpi=100, facecolor=bg)
    fig.text(0.01, 1 - 0.35 / height, title, color=fg, fontsize=14, va="center")
    fig.text(0.01, 0.18 / height, footer, color=muted, fontsize=9, va="center")
    to_dates = lambda ts: [datetime.fromtimestamp(t) for t in ts]  # noqa: E731

    for panel in dash["panels"]:
        g = panel["gridPos"]
        x0, y0 = g["x"] * unit_w + 0.05, top_in + g["y"] * unit_h + 0.05  # inches from top left
        w_in, h_in = g["w"] * unit_w - 0.1, g["h"] * unit_h - 0.1
        if panel["type"] == "row":
            fig.text(
                x0 / width,
                1 - (y0 + h_in / 2) / height,
                "⌄ " + panel["title"],
                color=fg,
                fontsize=12,
                weight="bold",
                va="center",
            )
            continue
        fig.add_artist(
            Rectangle(
                (x0 / width, 1 - (y0 + h_in) / height),
                w_in / width,
                h_in / height,
                transform=fig.transFigure,
                facecolor=panel_bg,
                edgecolor="#2c3235",
                lw=0.8,
                zorder=-1,
            )
        )
        fig.text(
            (x0 + 0.1) / width,
            1 - (y0 + 0.17) / height,
            panel["title"],
            color=fg,
            fontsize=10.5,
            va="center",
            weight="bold",
        )
        # The plot inside the panel, under its title, room left for the axis labels.
        left, right, top, bottom = (
            (0.08, 0.08, 0.35, 0.08) if panel["type"] != "timeseries" else (0.7, 0.15, 0.4, 0.62)
        )
        ax = fig.add_axes(
            [
                (x0 + left) / width,
                1 - (y0 + h_in - bottom) / height,
                (w_in - left - right) / width,
                (h_in - top - bottom) / height,
            ],
            facecolor=panel_bg,
        )
        for spine in ax.spines.values():
            spine.set_visible(panel["type"] == "timeseries")
            spine.set_color("#2c3235")
        ax.tick_params(colors=muted, labelsize=7.5)
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit")
        results = {}
        for target in panel.get("targets", []):
            results.update(panel_series(evaluator, target, subs))
        if panel["type"] == "table":
            ax.set_xticks([]), ax.set_yticks([])
            last = evaluator.eval(parse(panel["targets"][0]["expr"]), len(scrapes) - 1)
            lines = sorted(
                "   ".join(f"{k}={v}" for k, v in sorted(dict(ls).items())) for ls in last
            )
            ax.text(
                0.02,
                0.92,
                "\n".join(lines) or "No data",
                color=fg,
                fontsize=7.5,
                va="top",
                family="monospace",
                transform=ax.transAxes,
            )
            continue
        if panel["type"] == "stat":
            ax.set_xticks([]), ax.set_yticks([])
            values = [vs for ts, vs in results.values()]
            text = fmt(values[0][-1], unit) if values and values[0] else "No data"
            ax.text(
                0.5,
                0.5,
                text,
                color=colors[0] if values else muted,
                fontsize=24,
                ha="center",
                va="center",
                weight="bold",
                transform=ax.transAxes,
            )
            for ts, vs in results.values():  # the sparkline (graphMode "area")
                twin = ax.twinx()
                twin.fill_between(to_dates(ts), vs, color=colors[0], alpha=0.15, lw=0)
                twin.set_ylim(0, max(vs) * 2.5 or 1), twin.axis("off")
            continue
        for n, (legend, (ts, vs)) in enumerate(sorted(results.items())):
            color = colors[n % len(colors)]
            ax.plot(to_dates(ts), vs, color=color, lw=1.2, label=legend)
            ax.fill_between(to_dates(ts), vs, color=color, alpha=0.08, lw=0)
        if not results:
            ax.text(
                0.5, 0.5, "No data", color=muted, ha="center", va="center", transform=ax.transAxes
            )
        ax.set_xlim(*to_dates([scrapes[0].t, scrapes[-1].t]))
        ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))
        ax.xaxis.set_major_locator(mdates.AutoDateLocator(maxticks=5))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _, u=unit: fmt(v, u)))
        ax.set_ylim(bottom=0)
        ax.grid(color="#2c3235", lw=0.5)
        if results:  # under the plot, as Grafana's "list" legend
            longest = max(len(legend) for legend in results)
            ncol = max(1, min(4, len(results), int(w_in / (0.07 * longest + 0.45))))
            ax.legend(
                loc="upper left",
                bbox_to_anchor=(-0.02, -0.13),
                fontsize=7.5,
                frameon=False,
                labelcolor=fg,
                ncol=ncol,
                borderaxespad=0,
                handlelength=1.2,
                columnspacing=1.2,
                labelspacing=0.2,
            )
    fig.savefig(out_path, facecolor=bg)
    plt.close(fig)
