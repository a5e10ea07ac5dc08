"""TLS certificate files to a client's `Security`, without a cluster (TLS clusters for real:
tests/cluster/test_tls_cluster.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

import workbench
from workbench.errors import ConfigError

from helpers import certificate_files


def test_security_from_files_builds_a_client_security_or_none(tmp_path):
    files = certificate_files(tmp_path)
    security = workbench.security_from_files(files["ca"], files["cert"], files["key"])
    assert security.require_encryption
    assert (security.tls_ca_file, security.tls_client_cert, security.tls_client_key) == (
        files["ca"], files["cert"], files["key"])
    assert workbench.security_from_files(None, None, None) is None
    combined = tmp_path / "combined.pem"  # the key may be appended to the certificate
    combined.write_text(Path(files["cert"]).read_text() + Path(files["key"]).read_text())
    assert workbench.security_from_files(files["ca"], combined).tls_client_key is None
    with pytest.raises(ConfigError, match="cert=.*private key"):
        workbench.security_from_files(files["ca"], files["cert"])  # a certificate without its key
    with pytest.raises(ConfigError, match="ca_file=.*PEM"):
        workbench.security_from_files(files["key"], files["cert"], files["key"])  # a key is no CA certificate
