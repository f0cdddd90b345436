"""The header: trace and source, pool and page configuration, version, step N of M,
simulated time, replay speed and play state."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.table import Table
from rich.text import Text
from textual.widgets import Static

if TYPE_CHECKING:
    from kvtrace.tui.driver import Frame
    from kvtrace.tui.sources import SourceInfo

__all__ = ["ReplayHeader", "clock_time", "speed_label"]


def clock_time(seconds: float) -> str:
    """Simulated seconds as H:MM:SS.s."""
    s = max(seconds, 0.0)
    return f"{int(s // 3600)}:{int(s % 3600 // 60):02d}:{s % 60:04.1f}"


def speed_label(speed: float | None, achieved: float | None) -> str:
    """'max (1,131× real time)' / '100× (98×)'."""
    asked = "max" if speed is None else f"{speed:,.0f}×"
    return asked if achieved is None else f"{asked} ({achieved:,.0f}× real time)"


class ReplayHeader(Static):
    """Two lines about the replay; ``show`` redraws it for a frame."""

    def show(self, info: SourceInfo, frame: Frame) -> None:
        if frame.done:
            state = Text("■ done", style="bold red" if frame.alerts else "bold")
        elif frame.playing:
            state = Text("▶ playing", style="bold green")
        else:
            state = Text("‖ paused", style="bold yellow")
        step = "-" if frame.step is None else f"{frame.step:,}"
        total = f" of {info.last_step:,}" if info.last_step is not None else ""
        grid = Table.grid(expand=True)
        grid.add_column(ratio=1)
        grid.add_column(justify="right")
        grid.add_row(
            Text.assemble(("kvtrace ", "bold"), (info.name, "bold cyan"), "  ", (info.source, "dim")),
            Text.assemble("version ", (info.version, "bold"), "  ", state),
        )
        grid.add_row(
            Text(info.config + ("" if info.live else " · from a state log")),
            Text.assemble(
                ("step ", "dim"), (step, "bold"), total,
                ("  t=", "dim"), clock_time(frame.time_s),
                ("  speed ", "dim"), speed_label(frame.speed, frame.achieved_speed if frame.playing else None),
            ),
        )
        self.update(grid)
