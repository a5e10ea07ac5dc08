"""User interfaces of the workbench: the notebook control panel (ipywidgets) and the team dashboard
(Panel, in `widgets.dashboard`, imported on demand).

This layer imports `workbench`, never the reverse: a `workbench.Run` shown in a notebook looks up
`widgets.ControlPanel` by name at display time.
"""
from .compare import compare_runs
from .control_panel import ControlPanel

__all__ = ["ControlPanel", "compare_runs"]
