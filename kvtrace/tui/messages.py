"""Messages from the replay driver's thread to the UI (``App.post_message`` is thread-safe)."""

from __future__ import annotations

from textual.message import Message

from kvtrace.tui.driver import CellInfo, Failure, Frame, RequestHistory

__all__ = ["CellInfoReady", "FrameReady", "HistoryReady", "ReplayFailed"]


class FrameReady(Message):
    """A new frame; a newer one replaces it in the queue (the screen shows the latest)."""

    def __init__(self, frame: Frame) -> None:
        super().__init__()
        self.frame = frame

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, FrameReady)


class CellInfoReady(Message):
    """The pages and owners of the page-map cell the user selected."""

    def __init__(self, info: CellInfo) -> None:
        super().__init__()
        self.info = info


class HistoryReady(Message):
    """A request's history of lengths, for the detail screen."""

    def __init__(self, history: RequestHistory) -> None:
        super().__init__()
        self.history = history


class ReplayFailed(Message):
    """An error inside the replay: shown as a notification and in the events log."""

    def __init__(self, failure: Failure) -> None:
        super().__init__()
        self.failure = failure


def wrap(item: object) -> Message:
    """The message carrying a driver's ``item``."""
    if isinstance(item, Frame):
        return FrameReady(item)
    if isinstance(item, CellInfo):
        return CellInfoReady(item)
    if isinstance(item, RequestHistory):
        return HistoryReady(item)
    if isinstance(item, Failure):
        return ReplayFailed(item)
    raise TypeError(f"the driver posted an unknown item {type(item).__name__}")
