"""User interfaces of the workbench: the notebook control panel (ipywidgets) and the team dashboard (Panel).

This layer imports `workbench`, never the reverse. The control panel and dashboard arrive with their
own issues; until then the engine is driven through `workbench.Run` and the `workbench` CLI.
"""
