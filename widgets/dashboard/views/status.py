"""The status line beside the run picker: the picked run's state, strategy, owner and rate, the viewer's
role on it, and the run's warnings (a run that is not learning says so here)."""
from __future__ import annotations

from typing import Any

import panel as pn

from .common import Context


class StatusLine:
    """One line of text about the picked run, redrawn at most once a second unless its state changes."""

    scope = "run"  # drawn when the picked run's view changed

    def __init__(self, context: Context) -> None:
        self.context = context
        self.pane = pn.pane.Markdown("", sizing_mode="stretch_width")
        self._drawn: tuple[str, int] | None = None  # the status and number of warnings on screen

    def draw(self, view: dict[str, Any], force: bool) -> None:
        info, warnings = view["info"], view.get("warnings") or []
        # The rate changes with every step; the status and a new warning are news, shown at once.
        if not self.context.screen.due("status", 1.0, force or (view["status"], len(warnings)) != self._drawn):
            return
        self._drawn = (view["status"], len(warnings))
        role = self.context.access.role(self.context.user, info.get("owner"))
        self.context.screen.show("status", self.pane,
                                 f"**{view['status']}** · {info.get('strategy', '')} · owner {info.get('owner', '?')} · "
                                 f"{view['samples_per_s']:,.0f} samples/s · your role: {role}"
                                 + "".join(f"\n\n⚠ {text}" for text in warnings))
