"""What every dashboard view is given and draws with: the `Context` (hub, viewer, picked run), the
session's `Screen` (what the browser has now, so that a redraw sends only what changed), `HtmlBlock` for
text redrawn every second, the figure style, the palette and the time format."""
from __future__ import annotations

import dataclasses
import datetime
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd
import panel as pn
from bokeh.models import ColumnDataSource, Div
from bokeh.palettes import Category10_10
from bokeh.plotting import figure as bokeh_figure

from ..access import Access
from ..hub import Hub

COLOURS = Category10_10
MARKER_COLOUR = "#9a6700"
PLOT_HEIGHT = 230
# Control and warning markers: drawn on both run tabs from one source, which the overview sends.
MARKER_COLUMNS = {"step": [], "elapsed": [], "label": []}


class Screen:
    """One session's plot sources, and what its browser has now per source and pane.

    Every update costs the browser a redraw, and with many viewers those redraws are what training pays
    for: `send` and `show` pass on only what changed. Sources are made here, one per name, because the
    browser tests and the latency probe find them by name, and a name must be unique in a document.
    """

    def __init__(self) -> None:
        self.sources: dict[str, ColumnDataSource] = {}
        self._sent: dict[str, Any] = {}  # per source or pane: what the browser has now
        self._drawn_at: dict[str, float] = {}

    def source(self, name: str, columns: dict[str, list[Any]]) -> ColumnDataSource:
        """The source called `name`, made with empty `columns` the first time it is asked for."""
        if name not in self.sources:
            self.sources[name] = ColumnDataSource({key: list(value) for key, value in columns.items()}, name=name)
        return self.sources[name]

    def send(self, name: str, data: dict[str, list[Any]]) -> None:
        """Give a plot's source new data, unless it is what the browser already has."""
        if self._sent.get(name) != data:
            self._sent[name] = data
            self.sources[name].data = {key: _packed(column) for key, column in data.items()}

    def show(self, name: str, pane: Any, value: Any) -> None:
        """Set a pane's content when it changed (tables and text are re-rendered whole)."""
        key = value.to_json() if isinstance(value, pd.DataFrame) else value
        if self._sent.get(name) != key:
            self._sent[name] = key
            pane.object = value

    def due(self, name: str, period_s: float, now: bool = False) -> bool:
        """Whether `name` may be redrawn: `now`, or at least `period_s` after its last redraw."""
        if now or time.monotonic() - self._drawn_at.get(name, float("-inf")) >= period_s:
            self._drawn_at[name] = time.monotonic()
            return True
        return False

    def forget(self) -> None:
        """Send everything again at the next draw (another run was picked: nothing on screen is its)."""
        self._sent.clear()


def _packed(column: list[Any]) -> Any:
    """Numbers as NumPy arrays, which Bokeh sends as binary buffers: a quarter of the cost per session of
    encoding a list of floats (measured, 400 points), and every session pays it at every redraw. Other
    columns (labels, colours) as they are; a multi-line's list of lists as a list of arrays."""
    if not column:
        return column
    first = column[0]
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return np.asarray(column, dtype=float)
    if isinstance(first, list) and all(isinstance(x, (int, float)) for inner in column for x in inner[:1]):
        return [np.asarray(inner, dtype=float) for inner in column]
    return column


def send_markers(screen: Screen, view: dict[str, Any]) -> None:
    """The control and warning markers of both run tabs (one source; whichever tab is drawn sends it)."""
    markers = view["markers"]
    screen.send("markers", {
        "step": [m["step"] for m in markers], "label": [m["label"] for m in markers],
        "elapsed": [m["elapsed"] if m["elapsed"] is not None else float("nan") for m in markers]})


class SharedRender:
    """What every session would make alike from one run view (an HTML table, say), made once per view:
    sessions draw the same shared view object, so the first one to draw it pays. Keeps the last few."""

    def __init__(self, make: Callable[[Any], Any], keep: int = 8) -> None:
        self.make, self.keep = make, keep
        self._made: list[tuple[Any, Any]] = []  # (view, what was made), newest last

    def __call__(self, view: Any) -> Any:
        for made_from, made in self._made:
            if made_from is view:
                return made
        made = self.make(view)
        self._made = (self._made + [(view, made)])[-self.keep:]
        return made


# Tables look as in Panel's own panes: its style sheet for `panel-df` tables, in each block's shadow root.
_PANEL_TABLE_CSS = Path(pn.__file__).parent / "dist" / "css" / "dataframe.css"
TABLE_CSS = _PANEL_TABLE_CSS.read_text() if _PANEL_TABLE_CSS.exists() else "table.panel-df {border-collapse: collapse}"


class HtmlBlock:
    """HTML a session redraws every second or so (a table, a status line): a Bokeh `Div` whose text is set
    directly. Panel's HTML pane made the document re-collect all its models at each update (the pane's
    properties hold style-sheet models, and Bokeh re-walks the document when a changed property may
    hold models): an eighth of a session's redraw, measured with py-spy at 10 sessions."""

    def __init__(self, css_class: str | None = None) -> None:
        self.div = Div(text="", sizing_mode="stretch_width", css_classes=[css_class] if css_class else [],
                       stylesheets=[TABLE_CSS])
        self.layout = pn.pane.Bokeh(self.div, sizing_mode="stretch_width")

    @property
    def object(self) -> str:
        return self.div.text

    @object.setter
    def object(self, html: str) -> None:
        self.div.text = html


@dataclasses.dataclass(frozen=True)
class Context:
    """What a view draws from and acts through: the shared hub, this session's screen, and the viewer."""

    hub: Hub
    screen: Screen
    access: Access
    user: str | None
    selected: Callable[[], str | None]  # the run the viewer picked, read when needed (a click, a draw)


def figure(title: str, x_label: str, y_label: str, **options: Any) -> Any:
    """A Bokeh figure in the dashboard's style: full width, fixed height, pan/zoom/reset/save."""
    plot = bokeh_figure(title=title, height=PLOT_HEIGHT, sizing_mode="stretch_width",
                        tools="pan,wheel_zoom,reset,save", toolbar_location="above", **options)
    plot.xaxis.axis_label, plot.yaxis.axis_label = x_label, y_label
    return plot


def when(timestamp: float | None) -> str:
    return datetime.datetime.fromtimestamp(timestamp).strftime("%Y-%m-%d %H:%M:%S") if timestamp else ""
