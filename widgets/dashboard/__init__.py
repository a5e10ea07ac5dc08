"""The team dashboard: a Panel app showing every run on a Dask cluster live, with history and roles.

`workbench dashboard --scheduler ADDRESS` serves it in its own process; `serve_dashboard(client)` serves
it from a notebook; `dashboard(client)` shows it inline. See `hub` (data), `app` (the page of one
viewer), `views/` (one file per view), `access` (who may act) and `serve` (the command).
"""
from .access import Access
from .hub import FollowedRun, Hub
from .serve import DashboardServer, dashboard, serve_dashboard

__all__ = ["Access", "DashboardServer", "FollowedRun", "Hub", "dashboard", "serve_dashboard"]
