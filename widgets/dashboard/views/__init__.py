"""The dashboard's views, one per file, each a small class over the hub's data.

A view is made from a `Context` (hub, screen, viewer, picked run) and has a `layout` and a `draw`; its
`scope` says what it draws from:

- `"runs"`: every run's row (`Hub.runs()`), at every refresh: `draw(rows)`. The runs list and compare.
- `"run"`: the picked run's live view (`FollowedRun.view()`), when it changed or the viewer picked another
  run (`force`): `draw(view, force)`. The overview, the details, the controls and the status line.

A tab view also has a `title`. To add one, write it here and list it in `TABS`: the session builds,
lays out and draws every tab from that tuple.
"""
from .common import Context, Screen
from .compare import CompareView
from .controls import Controls, SettingsForm
from .details import RunDetails
from .overview import RunOverview
from .runs import RunsList
from .status import StatusLine
from .workers import WorkersView

# The tabs, in order; the session opens on the second (the picked run).
TABS = (RunsList, RunOverview, RunDetails, CompareView, WorkersView)

__all__ = ["TABS", "CompareView", "Context", "Controls", "RunDetails", "RunOverview", "RunsList", "Screen",
           "StatusLine", "WorkersView", "SettingsForm"]
