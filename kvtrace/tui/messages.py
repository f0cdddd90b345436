"""Messages from the replay driver's thread to the UI (``App.post_message`` is thread-safe)."""

from __future__ import annotations

from textual.message import Message

from kvtrace.tui.driver import CellInfo, Failure, Frame, RequestExplanation, RequestHistory

__all__ = ["CellInfoReady", "ExplanationReady", "FrameReady", "HistoryReady", "ReplayFailed"]


class FrameReady(Message):
    """A new frame; a newer one of the same side replaces it in the queue (the screen
    shows the latest of each side)."""

    def __init__(self, frame: Frame) -> None:
        super().__init__()
        self.frame = frame

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, FrameReady) and message.frame.side == self.frame.side


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


class ExplanationReady(Message):
    """A request's missed prefix tokens by cause, for the explain panel."""

    def __init__(self, explanation: RequestExplanation) -> None:
        super().__init__()
        self.explanation = explanation


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
    if isinstance(item, RequestExplanation):
        return ExplanationReady(item)
    raise TypeError(f"the driver posted an unknown item {type(item).__name__}")
