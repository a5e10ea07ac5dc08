"""The dashboard as a `panel serve` application, for teams that run Panel's server themselves:

    panel serve "$(python -m widgets.dashboard --app-path)" --port 5006 \
        --basic-auth credentials.json --cookie-secret "$SECRET" \
        --args --scheduler tcp://scheduler:8786 --runs-dir /shared/runs --admins alice,bob

(a TLS scheduler: `--scheduler tls://scheduler:8786 --tls-ca-file ca.pem --tls-cert client.pem
--tls-key client-key.pem` after `--args`.)

Panel's own flags (sign-in, TLS, origins, processes) go before `--args`; the workbench's after it. The
hub (one Dask client and one subscription per run) is cached per server process and shared by sessions.
"""
from __future__ import annotations

import argparse
import sys

import panel as pn

from widgets.dashboard.access import Access
from widgets.dashboard.app import REFRESH_MS, DashboardSession
from widgets.dashboard.hub import Hub
from workbench.cli.arguments import add_tls_arguments, tls_security
from workbench.cluster import connection as cluster_module


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="panel serve ... --args")
    parser.add_argument("--scheduler", required=True)
    add_tls_arguments(parser)  # --tls-ca-file, --tls-cert, --tls-key: to reach a tls:// scheduler
    parser.add_argument("--runs-dir", default="runs")
    parser.add_argument("--admins", default="")
    parser.add_argument("--open-control", action="store_true",
                        help="without sign-in, let anyone who reaches the page control runs")
    parser.add_argument("--refresh-ms", type=int, default=REFRESH_MS)
    return parser.parse_args(sys.argv[1:])


arguments = _arguments()
hub = pn.state.as_cached("workbench-dashboard-hub", lambda: Hub(
    cluster_module.connect(scheduler=arguments.scheduler, security=tls_security(arguments)),
    arguments.runs_dir).start())
# Sign-in is on when Panel was started with --basic-auth or --oauth-provider.
sign_in = bool(pn.config.oauth_provider or getattr(pn.config, "_basic_auth", None) or pn.state.user)
access = Access(sign_in=sign_in, admins=frozenset(a.strip() for a in arguments.admins.split(",") if a.strip()),
                open_control=not sign_in and arguments.open_control)
session = DashboardSession(hub, access, user=pn.state.user)
callback = pn.state.add_periodic_callback(session.refresh, period=arguments.refresh_ms)
pn.state.on_session_destroyed(lambda _context: callback.stop())
session.layout.servable(title="Training workbench")
