"""The benchmarks' page and result files (benchmarks/pages.py, catalog.py, resultfile.py): the page says
what the files say, every current file holds its provenance and headline keys, and a result without its
provenance is never written."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import catalog  # noqa: E402
import pages  # noqa: E402
import resultfile  # noqa: E402


def test_the_benchmarks_page_is_what_the_result_files_say():
    assert pages.PAGE.read_text() == pages.render(), \
        "docs/benchmarks.md is out of date with benchmarks/results/: run python -m benchmarks render"


def test_the_pictures_the_page_shows_are_drawn_and_none_is_left_over():
    assert pages.picture_problems() == []


def test_a_picture_is_named_by_its_results_commit_and_drawn_once_by_its_script(tmp_path, monkeypatch):
    benchmark = next(b for b in catalog.BENCHMARKS if b.name == "fidelity-thin")
    curve = [{"step": 0, "seconds": 0.0, "loss": 3.5}, {"step": 8, "seconds": 2.0, "loss": 3.1}]
    result = {"commit": "abcdef0123", "date": "2026-12-05T01:00:00", "target_loss": 3.2,
              "settings": {"model": "gpt-mini", "context": 64, "budget": "8 steps"},
              "cells": [{"condition": "10mbit", "config": "ddp", "curve": curve, "samples_per_step": 64},
                        {"condition": "10mbit", "config": "average p1", "curve": curve, "samples_per_step": 64}]}
    assert pages.picture_for("cpu-2core", benchmark, {**result, "cells": [{"config": "alone"}]}) is None
    monkeypatch.setattr(pages, "FIGURES", tmp_path / "figures")
    picture = tmp_path / "figures" / "cpu-2core-fidelity-thin-abcdef0.png"
    assert pages.picture_for("cpu-2core", benchmark, result) == picture
    result_path = tmp_path / "fidelity-thin.json"
    result_path.write_text(json.dumps(result))
    monkeypatch.setattr(pages, "pictures", lambda: {picture: (benchmark, result_path)})
    picture.parent.mkdir()
    (picture.parent / "cpu-2core-fidelity-thin-1234567.png").write_bytes(b"an older result's")
    assert pages.draw() == [picture]  # by fidelity.py's draw, as `fidelity.py --draw` does
    assert sorted(p.name for p in picture.parent.iterdir()) == [picture.name]  # the older one removed
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert pages.draw() == [] and pages.draw(redraw=True) == [picture]
    picture.unlink()
    (picture.parent / "left-over.png").write_bytes(b"")
    assert pages.picture_problems() == [
        f"{picture}: shown on the page, not drawn (python -m benchmarks render)",
        f"{picture.parent / 'left-over.png'}: drawn, shown by no current result"]
    monkeypatch.setattr(pages, "FIGURES", resultfile.FIGURES)
    monkeypatch.setattr(pages, "pictures", lambda: {resultfile.FIGURES / "absent.png": (benchmark, result_path)})
    assert pages.picture_problems()[0] == \
        "docs/figures/absent.png: shown on the page, not drawn (python -m benchmarks render)"


def test_a_result_with_curves_from_a_script_that_cannot_draw_them_is_refused_by_name(tmp_path, monkeypatch):
    benchmark = next(b for b in catalog.BENCHMARKS if b.name == "time-to-accuracy")
    monkeypatch.setattr(pages, "FIGURES", tmp_path)
    result_path = tmp_path / "time-to-accuracy.json"
    monkeypatch.setattr(pages, "pictures", lambda: {tmp_path / "a.png": (benchmark, result_path)})
    with pytest.raises(RuntimeError, match="time_to_accuracy.py has no draw"):
        pages.draw()
    assert not (tmp_path / "a.png").exists()


def test_every_current_result_file_is_a_benchmarks_and_holds_its_keys():
    assert pages.problems() == []


def test_the_catalog_names_each_benchmark_once_with_a_script_that_exists():
    names = [b.name for b in catalog.BENCHMARKS]
    assert len(names) == len(set(names))
    for benchmark in catalog.BENCHMARKS:
        assert (resultfile.HERE / benchmark.script).is_file(), benchmark
        assert set(benchmark.suites) <= set(catalog.SUITES) and benchmark.headline, benchmark
    assert {b.name for b in catalog.in_suite("quick")} <= set(names)
    with pytest.raises(ValueError, match="suite 'fast': one of quick, cpu, lab, gpu"):
        catalog.in_suite("fast")


def test_a_result_is_written_whole_with_its_provenance_or_not_at_all(tmp_path):
    out = tmp_path / "cpu-2core" / "throughput.json"
    with pytest.raises(ValueError, match="a result file needs benchmark, commit, dirty, date, machine, settings"):
        resultfile.write(out, {"allreduce_vs_ddp": 1.0})
    assert not out.exists()
    document = {"benchmark": "throughput", "commit": "abc", "dirty": False, "date": "2026-11-29",
                "machine": {"class": "cpu-2core"}, "settings": {"workers": 2}, "allreduce_vs_ddp": 1.01}
    resultfile.write(out, document)
    assert json.loads(out.read_text()) == document
    assert [p.name for p in out.parent.iterdir()] == ["throughput.json"]  # no temporary file left


def test_a_machine_class_is_named_by_its_cores_or_its_gpu(monkeypatch):
    assert resultfile.path_for("chaos", "gpu-h200") == resultfile.RESULTS / "gpu-h200" / "chaos.json"
    monkeypatch.setenv("WORKBENCH_MACHINE_CLASS", "gpu-h100")
    assert resultfile.machine_class() == "gpu-h100"
    monkeypatch.delenv("WORKBENCH_MACHINE_CLASS")
    assert resultfile.machine_class() == f"cpu-{os.cpu_count()}core"  # torch here has no CUDA


def test_where_the_tree_is_no_clone_the_commit_and_its_state_are_as_the_caller_says(monkeypatch):
    monkeypatch.setenv("COMMIT", "0123abc")
    monkeypatch.setenv("DIRTY", "false")
    assert resultfile.commit() == {"commit": "0123abc", "dirty": False}
    monkeypatch.setenv("DIRTY", "True")
    assert resultfile.commit()["dirty"] is True  # and `python -m benchmarks run` refuses it
    monkeypatch.delenv("DIRTY")
    assert resultfile.commit()["dirty"] == "unknown"


def test_a_tree_is_dirty_for_code_changed_not_for_the_results_a_run_writes(tmp_path):
    # A run of several benchmarks writes the first one's result before the next starts: that file, and the
    # page rendered from the files, are outputs, not code a result measures.
    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "benchmarks" / "results" / "cpu-2core").mkdir(parents=True)
    (tmp_path / "docs").mkdir()
    files = {"workbench.py": "x = 1\n", "benchmarks/results/cpu-2core/scale.json": "{}\n", "docs/benchmarks.md": "#\n"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "start")
    assert not resultfile.tree_is_dirty(tmp_path)
    (tmp_path / "benchmarks/results/cpu-2core/scale.json").write_text('{"new": 1}\n')
    (tmp_path / "docs/benchmarks.md").write_text("# rendered\n")
    (tmp_path / "scratch.json").write_text("{}\n")  # untracked
    assert not resultfile.tree_is_dirty(tmp_path)
    (tmp_path / "workbench.py").write_text("x = 2\n")
    assert resultfile.tree_is_dirty(tmp_path)


def test_a_result_is_out_of_date_when_a_script_it_takes_code_from_changes(tmp_path, monkeypatch):
    # fidelity-tune runs fidelity.py's job and DDP ranks: a change there changes what its result measures.
    def git(*args):
        return subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True, text=True).stdout

    def commit(message):
        git("add", "-A")
        git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message)
        return git("rev-parse", "HEAD").strip()

    git("init", "-q")
    (tmp_path / "benchmarks").mkdir()
    for name in ("fidelity_tune.py", "fidelity.py", "auto.py"):
        (tmp_path / "benchmarks" / name).write_text("x = 1\n")
    measured = commit("measured here")
    result = tmp_path / "fidelity-tune.json"
    result.write_text(json.dumps({"commit": measured}))
    tune = catalog.BY_NAME["fidelity-tune"]
    monkeypatch.setattr(resultfile, "ROOT", tmp_path)
    monkeypatch.setattr(pages, "result_files", lambda: [("cpu-2core", tune, result)])
    assert pages.stale_results() == []
    (tmp_path / "benchmarks" / "auto.py").write_text("x = 2\n")  # a script it takes nothing from
    commit("another benchmark changed")
    assert pages.stale_results() == []
    (tmp_path / "benchmarks" / "fidelity.py").write_text("x = 2\n")
    commit("the job changed")
    assert pages.stale_results() == [(result, measured, ["benchmarks/fidelity.py"])]
    # Every script a benchmark is said to take code from exists, and is not its own.
    for benchmark in catalog.BENCHMARKS:
        for script in benchmark.measures:
            assert (resultfile.HERE / script).is_file() and script != benchmark.script, (benchmark.name, script)
