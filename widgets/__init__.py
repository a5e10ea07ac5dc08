"""User interfaces of the workbench: the notebook control panel (ipywidgets) and the team dashboard
(Panel, in `widgets.dashboard`, imported on demand).

This layer imports `workbench`, never the reverse: it registers its notebook display of a run
(`ControlPanel`) and its `workbench dashboard` command through entry points in pyproject.toml, which
the engine looks up by group (`workbench.extensions`).
"""
from .compare import compare_runs
from .control_panel import ControlPanel

__all__ = ["ControlPanel", "compare_runs"]
