"""The header: trace and source, pool and page configuration, version, step N of M,
simulated time, replay speed and play state."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.text import Text

from kvtrace.tui.widgets.text_lines import TextLines

if TYPE_CHECKING:
    from kvtrace.tui.driver import Frame
    from kvtrace.tui.remote.sources import SourceInfo

__all__ = ["ReplayHeader", "clock_time", "speed_label"]


def clock_time(seconds: float) -> str:
    """Simulated seconds as H:MM:SS.s."""
    s = max(seconds, 0.0)
    return f"{int(s // 3600)}:{int(s % 3600 // 60):02d}:{s % 60:04.1f}"


def speed_label(speed: float | None, achieved: float | None) -> str:
    """'max (1,131× real time)' / '100× (98×)'."""
    asked = "max" if speed is None else f"{speed:,.0f}×"
    return asked if achieved is None else f"{asked} ({achieved:,.0f}× real time)"


class ReplayHeader(TextLines):
    """Two lines about the replay; ``show`` redraws what changed for a frame."""

    def show(self, info: SourceInfo, frame: Frame) -> None:
        if frame.done:
            state = Text("■ done", style="bold red" if frame.alerts else "bold")
        elif frame.playing:
            state = Text("▶ playing", style="bold green")
        else:
            state = Text("‖ paused", style="bold yellow")
        if frame.busy:
            state.append(f" · {frame.busy}…", style="italic")
        step = "-" if frame.step is None else f"{frame.step:,}"
        total = f" of {info.last_step:,}" if info.last_step is not None else ""
        width = max(self.size.width - 2, 40)
        left1 = Text.assemble(("kvtrace ", "bold"), (info.name, "bold cyan"), "  ", (info.source, "dim"))
        right1 = Text.assemble("version ", (info.version, "bold"), "  ", state)
        left2 = Text(info.config + ("" if info.live else " · from a state log"))
        right2 = Text.assemble(
            ("step ", "dim"), (step, "bold"), total,
            ("  t=", "dim"), clock_time(frame.time_s),
            ("  speed ", "dim"), speed_label(frame.speed, frame.achieved_speed if frame.playing else None),
        )
        self.set_lines([_spread(left1, right1, width), _spread(left2, right2, width)])


def _spread(left: Text, right: Text, width: int) -> Text:
    """``left`` and ``right`` on one line of ``width`` cells (left cut first)."""
    room = width - right.cell_len - 1
    if left.cell_len > room:
        left = left[: max(room - 1, 0)] + Text("…")
    return Text.assemble(left, " " * max(width - left.cell_len - right.cell_len, 1), right)
