"""Starting the embedded cluster safely, checked before any process starts: more workers than the machine
holds are refused at once, and a script's main guard is recognised (issue 18, items 4 and 6). The command
line, an interrupted start-up and a script without a guard, for real:
tests/cluster/test_local_cluster_guards_cluster.py."""
import types

import psutil
import pytest

import workbench
from workbench.cluster.connection import check_local_capacity
from workbench.errors import ClusterError, ConfigError


def test_capacity_is_judged_by_cores_and_memory():
    check_local_capacity(8, 1, cores=2, memory_bytes=24 * 2**30)  # 4 threads a core still train
    with pytest.raises(ConfigError, match=r"^workers=9 .*at most 8 local workers on this machine \(2 cores, 24.0 GiB"):
        check_local_capacity(9, 1, cores=2, memory_bytes=24 * 2**30)
    with pytest.raises(ConfigError, match=r"at most 2 local workers"):
        check_local_capacity(3, 4, cores=2, memory_bytes=24 * 2**30)  # threads count, not processes
    with pytest.raises(ConfigError, match=r"at most 5 local workers .*2.0 GiB"):
        check_local_capacity(6, 1, cores=64, memory_bytes=2 * 2**30)  # memory bounds too


def test_too_many_local_workers_are_refused_before_any_process_starts():
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ConfigError) as caught:
        workbench.connect(workers=500)
    assert caught.value.parameter == "workers" and "cores" in str(caught.value) and "GiB" in str(caught.value)
    assert "oversubscribe=True" in str(caught.value)
    assert {p.pid for p in psutil.Process().children(recursive=True)} == children


def test_a_guarded_call_and_a_one_line_guard_are_let_through(tmp_path):
    class Frame:  # what inspect.stack() gives: the frame and the line it is at
        def __init__(self, source_file, lineno):
            self.frame = type("F", (), {"f_code": type("C", (), {"co_name": "<module>", "co_filename": str(source_file)}),
                                        "f_globals": {"__name__": "__main__"}})()
            self.lineno = lineno

    from workbench.cluster.connection import check_main_guard

    source = tmp_path / "script.py"
    lines = ["import workbench", "if __name__ == '__main__': workbench.connect()", "if __name__ == '__main__':",
             "    workbench.connect()", "workbench.connect()"]
    source.write_text("\n".join(lines) + "\n")
    script = types.SimpleNamespace(__file__=str(source), __name__="__main__", __spec__=None)
    check_main_guard([Frame(source, 2)], script)
    check_main_guard([Frame(source, 4)], script)
    with pytest.raises(ClusterError, match="line 5"):
        check_main_guard([Frame(source, 5)], script)
    # `python -m package` runs the package's __main__, which multiprocessing does not import again.
    check_main_guard([Frame(source, 5)], types.SimpleNamespace(
        __file__=str(source), __name__="__main__", __spec__=types.SimpleNamespace(name="tool.__main__")))
