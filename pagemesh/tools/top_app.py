"""The live terminal UI of `pagemesh top` (textual): the tables of `top_render`, refreshed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from rich.text import Text
from textual.app import App, ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Footer, Header, Static

from pagemesh.tools.top_render import groups_table, routers_table, summary_table, workers_table
from pagemesh.tools.top_snapshot import Snapshot, compute_rates


class TopApp(App[None]):
    """Reads a snapshot every `interval_s` (in a thread: the read blocks on Redis and HTTP)
    and redraws; the rates shown are over the window since the previous read."""

    TITLE = "pagemesh top"
    CSS = """
    #status { color: $text-muted; padding: 0 1; }
    .table { padding: 0 1 1 1; }
    """
    BINDINGS = [
        ("q", "quit", "Quit"),
        ("r", "refresh_now", "Refresh"),
        ("p", "toggle_pause", "Pause"),
    ]

    def __init__(self, read: Callable[[], Snapshot], interval_s: float, cluster: str) -> None:
        super().__init__()
        self._read = read
        self.interval_s = interval_s
        self.cluster = cluster
        self.paused = False
        self.num_refreshes = 0
        self._prev: Snapshot | None = None
        self._reading = False

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(id="status")
        with VerticalScroll():
            for name in ("summary", "groups", "workers", "routers"):
                yield Static(id=name, classes="table")
        yield Footer()

    async def on_mount(self) -> None:
        self.sub_title = f"cluster {self.cluster!r}"
        self.set_interval(self.interval_s, self.refresh_data)
        await self.refresh_data()

    async def refresh_data(self, force: bool = False) -> None:
        if (self.paused and not force) or self._reading:
            return
        self._reading = True
        try:
            snapshot = await asyncio.to_thread(self._read)
        except Exception as exc:  # Redis away: say so, keep the last view, try again
            self._set_status(f"read failed: {exc}", error=True)
            return
        finally:
            self._reading = False
        self.show(snapshot)

    def show(self, snapshot: Snapshot) -> None:
        """Draws one refresh; the rates are over the window since the last `show`."""
        rates = compute_rates(self._prev, snapshot)
        self._prev = snapshot
        self.num_refreshes += 1
        self.query_one("#summary", Static).update(summary_table(snapshot, rates, self.cluster))
        self.query_one("#groups", Static).update(groups_table(snapshot, rates))
        self.query_one("#workers", Static).update(workers_table(snapshot, rates))
        self.query_one("#routers", Static).update(routers_table(snapshot))
        self._set_status(
            f"updated {time.strftime('%H:%M:%S')}, every {self.interval_s:g}s"
            + ("  [paused]" if self.paused else "")
        )

    def _set_status(self, message: str, error: bool = False) -> None:
        self.query_one("#status", Static).update(Text(message, style="red" if error else ""))

    async def action_refresh_now(self) -> None:
        await self.refresh_data(force=True)

    def action_toggle_pause(self) -> None:
        self.paused = not self.paused
        self._set_status("paused (p to resume)" if self.paused else "resumed")
