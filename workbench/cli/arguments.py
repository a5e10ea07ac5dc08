"""Command-line pieces every `workbench` command shares, the engine's (`cli/main.py`) and those the UI adds
(`workbench dashboard`, `panel serve ... --args`): a parser whose usage errors are one line, and the
`--tls-*` flags that reach a TLS scheduler."""
from __future__ import annotations

import argparse
from typing import Any

from workbench.cluster import connection as cluster_module

EXIT_BAD_INPUT = 2


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the full usage stays available with --help)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see --help)\n")


def add_tls_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that reach a TLS scheduler, named as `dask scheduler` and `dask worker` name them."""
    parser.add_argument("--tls-ca-file", default=None, metavar="PEM",
                        help="the cluster's CA certificate (for a tls:// --scheduler)")
    parser.add_argument("--tls-cert", default=None, metavar="PEM", help="this client's TLS certificate")
    parser.add_argument("--tls-key", default=None, metavar="PEM",
                        help="the private key of --tls-cert (unless appended to it)")


def tls_security(arguments: argparse.Namespace) -> Any:
    """The `distributed.Security` the --tls-* flags describe (files checked), or None without them."""
    return cluster_module.security_from_files(arguments.tls_ca_file, arguments.tls_cert, arguments.tls_key,
                                              names=("--tls-ca-file", "--tls-cert", "--tls-key"))
