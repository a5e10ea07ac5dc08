"""The status line beside the run picker: the picked run's state, strategy, owner and rate, the viewer's
role on it, and the run's warnings (a run that is not learning says so here)."""
from __future__ import annotations

from html import escape
from typing import Any

from .common import Context, HtmlBlock


class StatusLine:
    """One line of text about the picked run, redrawn at most once a second unless its state changes."""

    scope = "run"  # drawn when the picked run's view changed

    def __init__(self, context: Context) -> None:
        self.context = context
        # HTML written here, not Markdown: each session would run the Markdown converter every second
        # (measured: a seventh of a session's redraw).
        self.pane = HtmlBlock()
        self._drawn: tuple[Any, ...] | None = None  # the status, number of warnings and auto's line on screen

    def draw(self, view: dict[str, Any], force: bool) -> None:
        info, warnings = view["info"], view.get("warnings") or []
        # The rate changes with every step; the status and a new warning are news, shown at once.
        drawn = (view["status"], len(warnings), view.get("auto"))
        if not self.context.screen.due("status", 1.0, force or drawn != self._drawn):
            return
        self._drawn = drawn
        role = self.context.access.role(self.context.user, info.get("owner"))
        lines = [f"<b>{escape(str(view['status']))}</b> · {escape(str(info.get('strategy', '')))} · owner "
                 f"{escape(str(info.get('owner', '?')))} · {view['samples_per_s']:,.0f} samples/s · your role: {escape(role)}",
                 *([escape(view["auto"])] if view.get("auto") else []), *(f"⚠ {escape(text)}" for text in warnings)]
        self.context.screen.show("status", self.pane, "".join(f"<p>{line}</p>" for line in lines))
