"""Serving the dashboard: `workbench dashboard ...` (its own process), one call from a notebook, or inline.

`main()` is the command: it connects its own Dask client to the scheduler (over TLS with the engine's
shared `--tls-ca-file/--tls-cert/--tls-key` flags), builds the shared hub and serves the Panel app on
localhost unless told another address, with optional basic auth or OAuth (Panel's own), HTTPS, a cookie
secret and allowed websocket origins. Bad arguments end in one line and a non-zero exit code. The UI
registers it as `workbench dashboard` through the `workbench.commands` entry point (pyproject.toml).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import socket
import ssl
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import panel as pn

from workbench.checks import check_number
from workbench.cli.arguments import OneLineParser, add_tls_arguments, tls_security
from workbench.cluster import connection as cluster_module
from workbench.comm.collectives import find_free_port
from workbench.errors import ClusterError, ConfigError, WorkbenchError

from .access import Access, load_credentials, policy
from .app import REFRESH_MS, DashboardSession, session_factory
from .hub import Hub

DEFAULT_PORT = 5006
# The command's process yields the CPU to training on a shared machine: measured on the 2-core VM with 10
# viewer sessions, the dashboard's 0.06 core at normal priority cost training 2-8% (README).
DEFAULT_NICE = 10
EXIT_BAD_INPUT = 2


@dataclasses.dataclass
class DashboardServer:
    """A dashboard served from this process (a notebook): its address, its hub, and `stop()`."""

    url: str
    hub: Hub
    thread: Any

    def stop(self) -> None:
        self.thread.stop()
        self.hub.close()

    def _repr_html_(self) -> str:
        return f'Dashboard at <a href="{self.url}" target="_blank">{self.url}</a>'


def dashboard(client: Any = None, runs_dir: str | Path | None = "runs", title: str = "Training workbench",
              refresh_ms: int = REFRESH_MS) -> Any:
    """The dashboard as a Panel object to show inline in a notebook (runs of `client`'s cluster).

    The notebook's user is the operator here: controls act on the runs, as the control panel does.
    """
    hub = Hub(_own_client(client), runs_dir, owns_client=True).start()
    session = DashboardSession(hub, Access(open_control=True), title=title)
    session.layout.hub = hub
    pn.state.add_periodic_callback(session.refresh, period=_checked_refresh(refresh_ms))
    return session.layout


def serve_dashboard(client: Any = None, runs_dir: str | Path | None = "runs", port: int = 0,
                    address: str = "127.0.0.1", basic_auth: str | Path | dict[str, str] | None = None,
                    admins: list[str] | tuple[str, ...] = (), cookie_secret: str | None = None,
                    refresh_ms: int = REFRESH_MS, title: str = "Training workbench", **panel_options: Any) -> DashboardServer:
    """Serve the dashboard from this process (a notebook) in a background thread; returns at once.

    port 0 picks a free port. basic_auth: a credentials file or dict {"user": "password"}; admins may
    control every run, owners their own. Other keyword arguments go to `panel.serve` (oauth_provider=...).
    """
    hub = Hub(_own_client(client), runs_dir, owns_client=True).start()
    credentials = load_credentials(basic_auth) if isinstance(basic_auth, (str, Path)) else basic_auth
    sign_in = bool(credentials or panel_options.get("oauth_provider"))
    access = policy(sign_in, list(admins), address)
    port = port or find_free_port(address)
    options = _auth_options(credentials, cookie_secret, panel_options)
    thread = pn.serve({"": session_factory(hub, access, _checked_refresh(refresh_ms), title)}, port=port,
                      address=address, websocket_origin=[f"{address}:{port}", f"localhost:{port}"], show=False,
                      threaded=True, title=title, verbose=False, **options)
    _wait_until_listening(address, port)
    return DashboardServer(url=f"http://{address}:{port}/", hub=hub, thread=thread)


def _wait_until_listening(address: str, port: int, timeout_s: float = 30.0) -> None:
    """The server thread starts listening a moment after `panel.serve` returns: wait, so the URL works."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((address, port), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise ClusterError(f"the dashboard did not start listening on {address}:{port} "
                                   f"within {timeout_s:.0f} s") from None
            time.sleep(0.05)  # nothing to wait on but the port itself


def first_page(url: str, process: Any, timeout_s: float = 60.0, describe: Any = lambda: "") -> Any:
    """The first page that a dashboard started as `process` (a `subprocess.Popen`) serves at `url`, once
    its port is open; RuntimeError (with `describe()`) when the process exits or nothing is served within
    `timeout_s`. For scripts and tests that start `workbench dashboard` and wait for it.

    Once the port is open, one request waits for its page as long as the deadline allows: a page asked
    again after a short timeout is a new session built beside the first, and on a loaded 2-core machine
    (200 runs to list) those piled up and none was ever served."""
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the dashboard exited with {process.returncode}: {describe()}")
        try:
            return urllib.request.urlopen(url, timeout=max(1.0, deadline - time.monotonic()))
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            if time.monotonic() >= deadline:
                raise RuntimeError(f"the dashboard did not answer within {timeout_s:.0f} s") from None
            time.sleep(0.05)  # polling a port that is not open yet: nothing to wait on


def _own_client(client: Any) -> Any:
    """A client of its own to the same scheduler: Dask keeps one handler per topic and client, so
    following runs on the notebook's client would take their metrics away from the notebook's runs."""
    from distributed import Client, get_client

    if client is None:
        try:
            client = get_client()
        except ValueError:
            raise ConfigError("client", None, "a Dask client", "Pass client=workbench.connect(...)") from None
    return Client(client.scheduler.address, security=client.security, set_as_default=False, timeout=30)


def _checked_refresh(refresh_ms: Any) -> int:
    check_number("refresh_ms", refresh_ms, 100, integer=True, unit="milliseconds")
    return refresh_ms


def _auth_options(credentials: dict[str, str] | None, cookie_secret: str | None,
                  options: dict[str, Any]) -> dict[str, Any]:
    options = dict(options)
    if credentials or options.get("oauth_provider"):
        # Panel signs its login cookies with this; a fixed secret keeps sessions valid across restarts.
        options["cookie_secret"] = cookie_secret or os.environ.get("PANEL_COOKIE_SECRET") or os.urandom(32).hex()
    if credentials:
        options["basic_auth"] = credentials
    return options


# --- the command ----------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="workbench dashboard",
                           description="Serve the team dashboard of every run on a Dask cluster.")
    add_arguments(parser)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scheduler", required=True, metavar="ADDRESS", help="the cluster's scheduler address")
    add_tls_arguments(parser)  # --tls-ca-file, --tls-cert, --tls-key: to reach a tls:// scheduler
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port to serve on (default {DEFAULT_PORT})")
    parser.add_argument("--address", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1: this machine only)")
    parser.add_argument("--runs-dir", default="runs", help="parent directory of run directories to replay")
    parser.add_argument("--basic-auth", metavar="FILE", default=None,
                        help='credentials file, JSON {"user": "password"}: sign-in required')
    parser.add_argument("--admins", default="", help="comma-separated users who may control every run")
    parser.add_argument("--cookie-secret", default=None,
                        help="secret that signs login cookies (default: $PANEL_COOKIE_SECRET, else random)")
    parser.add_argument("--oauth-provider", default=None, help="Panel OAuth provider (github, google, generic, ...)")
    parser.add_argument("--oauth-key", default=None)
    parser.add_argument("--oauth-secret", default=None)
    parser.add_argument("--oauth-redirect-uri", default=None)
    parser.add_argument("--oauth-encryption-key", default=None)
    parser.add_argument("--allow-websocket-origin", action="append", default=[], metavar="HOST[:PORT]",
                        help="public host names browsers reach the dashboard by (behind a proxy)")
    parser.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate")
    parser.add_argument("--ssl-keyfile", default=None, help="private key of --ssl-certfile")
    parser.add_argument("--refresh-ms", type=int, default=REFRESH_MS, help=f"how often sessions redraw (default {REFRESH_MS})")
    parser.add_argument("--nice", type=int, default=DEFAULT_NICE,
                        help=f"lower this process's CPU priority by this much (0-19, default {DEFAULT_NICE}): on a "
                             "machine that also trains, the dashboard takes what training leaves")


def main(argv: list[str] | None = None) -> int:
    """Serve the team dashboard of a cluster."""
    arguments = build_parser().parse_args(argv)
    try:
        return run(arguments)
    except WorkbenchError as error:
        print(f"workbench dashboard: error: {error}".splitlines()[0], file=sys.stderr)
        return EXIT_BAD_INPUT if isinstance(error, ValueError) else 1
    except KeyboardInterrupt:
        return 130


def run(arguments: argparse.Namespace) -> int:
    options = _checked_arguments(arguments)
    security = tls_security(arguments)  # the files are checked before connecting, and before renicing
    cluster_module.check_connection(arguments.scheduler, security)
    if arguments.nice:
        # Before any thread starts: on Linux a thread's niceness is its own, and new threads inherit it.
        os.nice(arguments.nice)
    client = cluster_module.connect(scheduler=arguments.scheduler, security=security)
    hub = Hub(client, arguments.runs_dir).start()
    sign_in = bool(arguments.basic_auth or arguments.oauth_provider)
    access = policy(sign_in, arguments.admins.split(","), arguments.address)
    origins = arguments.allow_websocket_origin or [f"{arguments.address}:{arguments.port}",
                                                   f"localhost:{arguments.port}"]
    scheme = "https" if arguments.ssl_certfile else "http"
    print(f"workbench dashboard: serving {scheme}://{arguments.address}:{arguments.port}/ "
          f"(sign-in {'on' if sign_in else 'off'}; control: "
          f"{'owners and admins' if sign_in else 'anyone on this machine' if access.open_control else 'nobody'})",
          flush=True)
    # Stopped by a signal (a service manager, a test), leave the cluster cleanly: unsubscribe, disconnect.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        pn.serve({"": session_factory(hub, access, arguments.refresh_ms)}, port=arguments.port,
                 address=arguments.address, websocket_origin=origins, show=False, threaded=False,
                 title="Training workbench", verbose=False, **options)
    finally:
        hub.close()
        client.close()
    return 0


def _interrupt(_signal: int, _frame: Any) -> None:
    raise KeyboardInterrupt


def _checked_arguments(arguments: argparse.Namespace) -> dict[str, Any]:
    """Check every argument before connecting; returns `panel.serve` options for sign-in and TLS."""
    if not 0 < arguments.port < 65536:
        raise ConfigError("--port", arguments.port, "a port number from 1 to 65535")
    _checked_refresh(arguments.refresh_ms)
    if not 0 <= arguments.nice <= 19:
        raise ConfigError("--nice", arguments.nice, "0 (the priority it was started with) to 19 (the lowest)")
    runs_dir = Path(arguments.runs_dir)
    if runs_dir.exists() and not runs_dir.is_dir():
        raise ConfigError("--runs-dir", arguments.runs_dir, "a directory (of run directories)")
    if arguments.basic_auth and arguments.oauth_provider:
        raise ConfigError("--oauth-provider", arguments.oauth_provider, "not together with --basic-auth",
                          "Choose one way to sign in")
    credentials = load_credentials(arguments.basic_auth) if arguments.basic_auth else None
    oauth = {key: getattr(arguments, key) for key in ("oauth_provider", "oauth_key", "oauth_secret",
                                                       "oauth_redirect_uri", "oauth_encryption_key")
             if getattr(arguments, key)}
    options = _auth_options(credentials, arguments.cookie_secret, oauth)
    if bool(arguments.ssl_certfile) != bool(arguments.ssl_keyfile):
        raise ConfigError("--ssl-keyfile" if arguments.ssl_certfile else "--ssl-certfile", None,
                          "both --ssl-certfile and --ssl-keyfile, or neither")
    if arguments.ssl_certfile:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            context.load_cert_chain(arguments.ssl_certfile, arguments.ssl_keyfile)
        except (OSError, ssl.SSLError) as error:
            raise ConfigError("--ssl-certfile", arguments.ssl_certfile, "a readable PEM certificate and key",
                              f"{type(error).__name__}: {error}") from None
        options["http_server_kwargs"] = {"ssl_options": context}
    return options
