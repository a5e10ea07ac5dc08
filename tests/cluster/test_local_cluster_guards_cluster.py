"""Starting the embedded cluster safely, for real: the command line refuses more workers than the machine
holds in one line, a script without a main guard is told what to do, an interrupted start-up leaves no
process behind, and a nanny's worker keeps freed memory (issue 18, items 4 and 6; the checks themselves,
before any process starts: tests/unit/test_local_cluster_guards.py)."""
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from helpers import cli_in_process, ctrl_c_at_default, wait_until

WORKBENCH = str(Path(sys.executable).with_name("workbench"))


@pytest.mark.timeout(60)
def test_the_cli_refuses_too_many_workers_in_one_line(tmp_path, capsys):
    code, lines = cli_in_process(["train", "--workers", "500", "--run-dir", str(tmp_path)], capsys)
    assert code == 2 and len(lines) == 1 and "workers=500" in lines[0], lines


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.timeout(120)
def test_an_interrupted_start_up_leaves_no_process_behind(signum, tmp_path):
    command = subprocess.Popen([WORKBENCH, "train", "--workers", "6", "--oversubscribe", "--no-progress",
                                "--run-dir", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               preexec_fn=ctrl_c_at_default)
    seen: set[psutil.Process] = set()

    def workers_starting() -> bool:  # interrupted while the cluster's processes are being spawned
        try:
            seen.update(psutil.Process(command.pid).children(recursive=True))
        except psutil.NoSuchProcess:
            return True
        return len(seen) >= 2

    try:
        wait_until(workers_starting, timeout_s=60)
        command.send_signal(signum)
        command.wait(timeout=60)
        gone, alive = psutil.wait_procs(list(seen), timeout=30)
        assert seen and not alive, f"left behind: {[p.pid for p in alive]}"
        assert command.returncode != 0
    finally:
        for process in [command, *seen]:
            try:
                process.kill()
            except (ProcessLookupError, psutil.Error):
                pass


@pytest.mark.timeout(90)
def test_a_script_without_a_main_guard_is_told_to_add_one(tmp_path):
    script = tmp_path / "train_script.py"
    script.write_text(textwrap.dedent("""\
        import workbench

        client = workbench.connect(workers=2)
        print("connected")
    """))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=80)
    assert result.returncode != 0 and "connected" not in result.stdout
    assert 'if __name__ == "__main__":' in result.stderr and "line 3: client = workbench.connect" in result.stderr
    assert "Nanny failed to start" not in result.stderr
    assert result.stderr.count("Traceback") == 1  # ours, not one per worker


def test_keep_freed_memory_undoes_the_nannys_malloc_trim_threshold():
    # A fresh process started as a nanny starts its worker: every 8 MB tensor is mapped afresh (about
    # 2,000 page faults) until the worker's allocator is told to keep freed memory.
    probe = textwrap.dedent("""
        import resource, torch
        from workbench.worker.host import keep_freed_memory
        def faults():
            for _ in range(3):
                torch.empty(2_000_000).fill_(1.0)
            before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            for _ in range(10):
                torch.empty(2_000_000).fill_(1.0)
            return (resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before) / 10
        untuned = faults()
        print(untuned, keep_freed_memory(), faults())
    """)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True,
                          env={**os.environ, "MALLOC_TRIM_THRESHOLD_": "65536"})
    untuned, applied, tuned = done.stdout.split()
    assert applied == "True" and float(untuned) > 500 and float(tuned) < 20
