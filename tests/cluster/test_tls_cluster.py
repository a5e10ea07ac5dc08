"""TLS clusters for real: a `LocalCluster(security=True)` trains (all-reduce and parameter-server actors),
the dashboard's own client follows it, and the `--tls-*` flags of `workbench train` / `workbench dashboard`
reach a `dask scheduler` started with certificate files (and refuse bad files in one line). Certificate files
to a client's `Security`, without a cluster: tests/unit/test_tls.py."""
from __future__ import annotations

import functools
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from distributed import Security

import workbench
from workbench.run.launcher import present_workers
from workbench.comm.collectives import find_free_port
from workbench.errors import ClusterError, ConfigError

from widgets.dashboard.serve import first_page

import helpers
from helpers import certificate_files, chromium, cli_in_process, dask_cluster_on_loopback, end_processes, wait_until

pytestmark = [pytest.mark.cluster]
WORKBENCH = str(Path(sys.executable).with_name("workbench"))


@pytest.fixture(scope="module")
def tls_client():
    """One TLS LocalCluster of 2 workers (temporary self-signed certificates) for this module."""
    client = workbench.connect(workers=2, security=True, dashboard_address=":0")
    try:
        yield client
    finally:
        workbench.shutdown(client)


def tls_flags(files: dict[str, str]) -> list[str]:
    return ["--tls-ca-file", files["ca"], "--tls-cert", files["cert"], "--tls-key", files["key"]]


digits_job = functools.partial(helpers.digits_job, epochs=3, lr=0.05)


# --- a TLS LocalCluster --------------------------------------------------------------------------------

@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy,changes", [
    ("allreduce", {"momentum": 0.9}),
    # Asynchronous updates act like extra momentum: 0.7, and smaller batches for more server versions.
    ("async", {"momentum": 0.7, "batch_size": 8}),
])
def test_tls_local_cluster_trains_to_080_heldout_accuracy(tls_client, tmp_path, strategy, changes):
    assert tls_client.scheduler.address.startswith("tls://")
    workers = present_workers(tls_client)
    assert len(workers) == 2 and all(address.startswith("tls://") for address in workers)
    run = workbench.train(digits_job(**changes), strategy, client=tls_client, run_dir=tmp_path / "runs")
    assert run.wait(timeout=180) == "finished"
    assert run.config["scheduler"] == tls_client.scheduler.address
    result = run.evaluate()
    assert result["accuracy"] >= 0.8, result


@pytest.mark.timeout(120)
def test_tls_scheduler_refuses_clients_without_the_clusters_certificates(tls_client):
    address = tls_client.scheduler.address
    with pytest.raises(ConfigError, match="TLS certificates for a tls:// scheduler"):
        workbench.connect(scheduler=address)  # no certificates at all: refused before connecting
    with pytest.raises(ClusterError, match="TLS"):
        workbench.connect(scheduler=address, security=Security.temporary(), timeout_s=10)  # another CA
    with pytest.raises(ConfigError, match="tls:// address"):
        workbench.connect(scheduler=address.replace("tls://", "tcp://"), security=tls_client.security)


@pytest.mark.timeout(180)
def test_dashboard_served_from_the_notebook_follows_a_run_on_the_tls_cluster(tls_client, tmp_path):
    from widgets.dashboard.serve import serve_dashboard

    run = workbench.train(digits_job(epochs=1), "allreduce", client=tls_client, run_dir=tmp_path / "runs")
    server = serve_dashboard(tls_client, runs_dir=None)
    try:
        assert server.hub.client.scheduler.address.startswith("tls://")
        assert server.hub.client is not tls_client
        assert urllib.request.urlopen(server.url, timeout=30).status == 200
        wait_until(lambda: run.run_id in [row["run"] for row in server.hub.runs()], timeout_s=60)
        assert run.wait(timeout=120) == "finished"
        feed = server.hub.feed(run.run_id)
        wait_until(lambda: feed.status == "finished" and feed.table.steps_received >= 2 * run.total_steps,
                   timeout_s=60)
    finally:
        server.stop()


# --- the command line ----------------------------------------------------------------------------------


@pytest.mark.timeout(200)
@pytest.mark.parametrize("command,extra,fragment", [
    ("dashboard", ["--tls-ca-file", "missing.pem"], "--tls-ca-file='missing.pem'"),
    ("train", ["--tls-ca-file", "missing.pem"], "--tls-ca-file='missing.pem'"),
    ("dashboard", ["--tls-ca-file", "{ca}"], "--tls-cert"),
    ("train", ["--tls-ca-file", "{ca}", "--tls-cert", "{cert}", "--tls-key", "{cert}"], "--tls-cert"),
    ("dashboard", [], "--tls-ca-file"),  # a tls:// scheduler without certificates
])
def test_cli_refuses_bad_tls_files_with_one_line(tmp_path, command, extra, fragment, capsys, monkeypatch):
    files = certificate_files(tmp_path)
    arguments = [argument.format(**files) for argument in extra]
    monkeypatch.chdir(tmp_path)  # where 'missing.pem' is looked for, and is not
    # Port 9 (discard) has no scheduler: a message about it would mean the files were not checked first.
    code, lines = cli_in_process([command, "--scheduler", "tls://127.0.0.1:9", *arguments], capsys)
    assert code == 2 and len(lines) == 1, lines
    assert fragment in lines[0] and "could not reach" not in lines[0], lines


def tls_dask_cluster(tmp_path: Path, files: dict[str, str], workers: int = 2):
    """`dask scheduler` and `dask worker` started with certificate files on 127.0.0.1; all ended on exit."""
    return dask_cluster_on_loopback(tmp_path, workers, tls_flags(files))


def assert_dashboard_lists(url: str, run_id: str) -> None:
    """Load the page in headless Chromium (Debian's, as in test_dashboard) and find `run_id` picked."""
    from playwright.sync_api import expect

    with chromium() as browser:
        page = browser.new_page()
        page.goto(url)
        page.wait_for_function("() => window.Bokeh && Bokeh.documents.length > 0", timeout=30_000)
        expect(page.get_by_role("combobox", name="Run", exact=True)).to_have_value(run_id, timeout=30_000)


@pytest.mark.timeout(300)
def test_cli_trains_on_and_serves_the_dashboard_of_a_tls_scheduler_started_with_certificate_files(tmp_path):
    files = certificate_files(tmp_path)
    with tls_dask_cluster(tmp_path, files) as address:
        assert address.startswith("tls://")
        client = workbench.connect(scheduler=address, security=workbench.security_from_files(
            files["ca"], files["cert"], files["key"]), timeout_s=30)
        try:
            client.wait_for_workers(2, timeout=90)
        finally:
            client.close()
        result = subprocess.run(
            [WORKBENCH, "train", "--scheduler", address, *tls_flags(files), "--epochs", "3", "--lr", "0.05",
             "--run-dir", str(tmp_path / "runs"), "--no-progress"], capture_output=True, text=True, timeout=200)
        assert result.returncode == 0, result.stderr
        accuracy = [line for line in result.stdout.splitlines() if line.startswith("held-out accuracy")]
        assert accuracy and float(accuracy[0].split()[-1]) >= 0.8, result.stdout
        run_id = result.stdout.split()[1].rstrip(":")

        # The dashboard gets no run directories: it can learn of the run only from the scheduler, over TLS.
        port = find_free_port("127.0.0.1")
        log = tmp_path / "dashboard.log"
        with log.open("w") as output:
            dashboard = subprocess.Popen(
                [WORKBENCH, "dashboard", "--scheduler", address, *tls_flags(files), "--port", str(port),
                 "--runs-dir", str(tmp_path / "no-runs-here")], stdout=output, stderr=subprocess.STDOUT)
        try:
            page = first_page(f"http://127.0.0.1:{port}/", dashboard, describe=log.read_text)
            assert page.status == 200
            assert "serving http://127.0.0.1" in log.read_text()
            assert run_id.startswith("allreduce-")
            assert_dashboard_lists(f"http://127.0.0.1:{port}/", run_id)
        finally:
            end_processes([dashboard])
        assert "Traceback" not in log.read_text(), log.read_text()
