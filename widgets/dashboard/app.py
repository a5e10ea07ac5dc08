"""One viewer's dashboard page: the header, the run picker, the controls and the tabs, redrawn once a
second (`REFRESH_MS`) from the shared `Hub`.

The page is put together here; what each part shows is a view in `views/` (one file each). A periodic
callback calls `DashboardSession.refresh`, which draws every view, and the `Screen` they share sends the
browser only what changed: the plots are Bokeh figures over named `ColumnDataSource`s, so a redraw sends
numbers, not pictures. Controls act only after `Access.may_control` allows the signed-in user
(`views/controls.py`).
"""
from __future__ import annotations

from typing import Any

import panel as pn

from .access import Access
from .hub import Hub
from .views import TABS, Context, Controls, Screen, StatusLine

# How often a session redraws by default. Each redraw costs the server and every viewer a message: 10
# sessions cost the dashboard process 0.08-0.11 core at 500 ms and 0.05-0.06 at 1000 ms, on a 2-core box
# that also trains (benchmarks/dashboard_cost.py). A step is on screen within about a second of its record.
REFRESH_MS = 1000


class DashboardSession:
    """What one viewer sees: the run picker with its status line, the controls and the tabs."""

    def __init__(self, hub: Hub, access: Access, user: str | None = None, title: str = "Training workbench") -> None:
        self.hub = hub
        self.access = access
        self.user = user
        self.title = title
        self.screen = Screen()
        self._ids: list[str] | None = None  # the runs on offer in the picker
        self._following_newest = True  # until the viewer picks a run, show the newest one
        self._selecting = False  # the selection being changed by `refresh`, not by the viewer
        self._drawn: Any = None  # the picked run's view on screen
        self.run_select = pn.widgets.Select(label="Run", options=[], width=420)
        self.run_select.param.watch(self._on_pick, "value")
        context = Context(hub, self.screen, access, user, selected=lambda: self.run_select.value)
        self.controls = Controls(context)
        self.status_line = StatusLine(context)
        self.tab_views = {view.title: view for view in (make(context) for make in TABS)}
        views = [*self.tab_views.values(), self.controls, self.status_line]
        self._views = {scope: [view for view in views if view.scope == scope] for scope in ("runs", "run")}
        self.header = pn.pane.Markdown(header_text(access, user, title), sizing_mode="stretch_width")
        # Only the open tab is rendered in the browser (dynamic): every plot on screen is redrawn at each
        # update, and with many viewers those redraws are the dashboard's main cost.
        self.tabs = pn.Tabs(*((title, view.layout) for title, view in self.tab_views.items()), active=1,
                            dynamic=True, sizing_mode="stretch_width")
        # Only the open tab is drawn too: the others are not in the browser, and drawing them cost every
        # session a tenth of its redraw for nothing. A tab opened is drawn in full at once.
        self.tabs.param.watch(lambda _event: self._draw_run(force=True), "active")
        self.layout = pn.Column(self.header, pn.Row(self.run_select, self.status_line.pane.layout, sizing_mode="stretch_width"),
                                self.controls.layout, self.tabs, sizing_mode="stretch_width")
        self.refresh()

    def refresh(self) -> None:
        """Redraw what changed (called every `REFRESH_MS` by the session's periodic callback)."""
        # Held: the redraw's changes go to the browser as one message. Unheld, Bokeh sends one message per
        # changed source or pane (five to eight a redraw), and each costs the server and the viewer alike.
        with pn.io.hold():
            rows = self.hub.runs()
            self._offer([row["run"] for row in rows])
            self._draw_run()
            for view in self._views["runs"]:
                view.draw(rows)

    def _offer(self, ids: list[str]) -> None:
        """Put the runs in the picker, newest first; follow the newest until the viewer picks one."""
        if ids == self._ids:
            return
        self._ids = ids
        self._selecting = True  # new options may move the selection: that is not the viewer's pick
        try:
            self.run_select.options = ids
            if ids and (self._following_newest or self.run_select.value not in ids):
                self.run_select.value = ids[0]
        finally:
            self._selecting = False

    def _on_pick(self, _event: Any) -> None:
        if not self._selecting:
            self._following_newest = False
        self._draw_run(force=True)

    def _draw_run(self, force: bool = False) -> None:
        """Draw the picked run's views when its view changed (a feed's view is the same object until new
        records arrive), or everything again when another run was picked (`force`)."""
        feed = self.hub.feed(self.run_select.value) if self.run_select.value else None
        if feed is None:
            return
        view = feed.view()
        if not force and view is self._drawn:
            return
        if force:
            self.screen.forget()
        self._drawn = view
        open_tab = list(self.tab_views.values())[self.tabs.active]
        for part in self._views["run"]:
            if part is open_tab or part not in self.tab_views.values():  # the open tab, controls, status
                part.draw(view, force)


def header_text(access: Access, user: str | None, title: str) -> str:
    """The page title and who the viewer is: signed in, on an open local dashboard, or view only."""
    who = f"signed in as **{user}**" if user else "not signed in"
    if access.sign_in:
        who += " · [sign out](/logout)" if user else ""
    elif access.open_control:
        who = "open dashboard on this machine: anyone here may control runs"
    else:
        who = "view only (no sign-in configured)"
    return f"## {title}\n{who}"


def session_factory(hub: Hub, access: Access, refresh_ms: int = REFRESH_MS, title: str = "Training workbench"):
    """The Panel app: each browser session gets its own views over the shared hub."""
    def make() -> Any:
        session = DashboardSession(hub, access, user=pn.state.user, title=title)
        callback = pn.state.add_periodic_callback(session.refresh, period=refresh_ms)
        pn.state.on_session_destroyed(lambda _context: callback.stop())
        return session.layout

    return make
