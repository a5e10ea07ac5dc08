"""The benchmarks' page, rendered from the result files alone, and which results are out of date.

`render()` gives `docs/benchmarks.md`: per machine class and benchmark, where the figures come from
(commit, date, machine, settings), the headline keys and the cells, every number read from the file.
`draw()` gives its pictures (`docs/figures/`): held-out loss against wall time for every result whose cells
hold curves, each named by its result's commit, so a picture of an older result is never the one shown, and
each drawn by the `draw(result, picture)` of the script that measured it (one way to draw a result).
Both are generated, never edited; tests/unit/test_benchmark_pages.py fails when the page differs from what
the files say, a picture it shows is missing or one is left over, or a file lacks its headline keys.
`stale_results()` compares each file's commit with HEAD, over the engine, its script and the scripts it
takes code from (`measures` in catalog.py).
"""
from __future__ import annotations

import importlib
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import catalog
import resultfile

PAGE = resultfile.PAGE
FIGURES = resultfile.FIGURES
MEASURED = ("workbench", "testbed", "planner")  # the code a result measures, besides its own script
MAX_ROWS = 60  # a cells table longer than this shows its first rows and says how many it left out


MACHINE_CLASS = re.compile(r"^(cpu-\d+core|gpu-[a-z]+\d+)$")  # the folders resultfile.machine_class() names


def machine_folders() -> list[Path]:
    return sorted(p for p in resultfile.RESULTS.iterdir() if p.is_dir() and MACHINE_CLASS.match(p.name))


def older_files() -> list[Path]:
    """Results in the layout before `python -m benchmarks` (directly under results/, or in folders of
    their own): kept until their benchmark is measured again, read by nothing but the earlier pages."""
    current = set(machine_folders())
    return sorted(p for p in resultfile.RESULTS.rglob("*") if p.is_file() and not any(f in p.parents for f in current))


def result_files() -> list[tuple[str, catalog.Benchmark, Path]]:
    """(machine class, benchmark, path) of every current result file, in the catalog's order."""
    found = []
    for machine in (p.name for p in machine_folders()):
        for benchmark in catalog.BENCHMARKS:
            path = resultfile.path_for(benchmark.name, machine)
            if path.is_file():
                found.append((machine, benchmark, path))
    return found


def problems() -> list[str]:
    """What is wrong with the result files: a file no benchmark writes, or one missing its keys."""
    found = []
    known = {path for _, _, path in result_files()}
    for path in sorted(p for folder in machine_folders() for p in folder.rglob("*")):
        if path.is_file() and path not in known:
            found.append(f"{path.relative_to(resultfile.ROOT)}: no benchmark in benchmarks/catalog.py writes it")
    for _, benchmark, path in result_files():
        result = resultfile.read(path)
        missing = [k for k in resultfile.PROVENANCE + benchmark.headline if k not in result]
        if missing:
            found.append(f"{path.relative_to(resultfile.ROOT)}: lacks {', '.join(missing)}")
    return found


def _value(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, (dict, list)):
        return "`" + json.dumps(value, default=str, separators=(", ", ": "))[:160] + "`"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _dig(row: dict[str, Any], column: str) -> Any:
    value: Any = row
    for part in column.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _cells(result: dict[str, Any], benchmark: catalog.Benchmark) -> list[str]:
    """The raw cells as a table: a list of rows, or a mapping of name to row."""
    cells = result.get(benchmark.rows)
    if not cells:
        return []
    rows = [{"name": name, **row} for name, row in cells.items()] if isinstance(cells, dict) else list(cells)
    columns = (("name",) if isinstance(cells, dict) else ()) + benchmark.columns
    if not benchmark.columns:
        columns += tuple(k for k, v in rows[0].items() if not isinstance(v, (dict, list)))[:8]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_value(_dig(row, c)) for c in columns) + " |" for row in rows[:MAX_ROWS]]
    if len(rows) > MAX_ROWS:
        lines.append(f"\n{len(rows) - MAX_ROWS} more rows in the file.")
    return lines


def _section(machine: str, benchmark: catalog.Benchmark, path: Path) -> list[str]:
    result = resultfile.read(path)
    clean = "" if result.get("dirty") is False else f" (tree dirty: {result.get('dirty')})"
    description = result["machine"].get("description") if isinstance(result["machine"], dict) else result["machine"]
    lines = [f"### {benchmark.title}", "",
             f"`benchmarks/results/{machine}/{benchmark.name}.json`: commit `{str(result['commit'])[:7]}`{clean}, "
             f"{str(result['date'])[:10]}, {description}. Measured again by "
             f"`python -m benchmarks run --only {benchmark.name}`.", ""]
    lines += ["| headline | value |", "|---|---:|"]
    lines += [f"| `{key}` | {_value(result.get(key))} |" for key in benchmark.headline]
    lines += ["", "Settings: " + _value(result["settings"]).strip("`")[:400], ""]
    if benchmark.script == "fidelity.py":
        import fidelity

        lines += [fidelity.table(result), ""]
    elif benchmark.script == "simulator.py":
        import simulator

        lines += [simulator.markdown_table(result), ""]
    else:
        lines += _cells(result, benchmark) + [""]
    if benchmark.script == "network.py" and result.get("auto_vs_best_fixed"):
        import network

        lines += [network.auto_table(result), ""]
    picture = picture_for(machine, benchmark, result)
    if picture is not None:
        lines += [f"![{benchmark.name}: held-out loss against wall time, each configuration]"
                  f"({picture.relative_to(PAGE.parent).as_posix()})", ""]
    return lines


def picture_for(machine: str, benchmark: catalog.Benchmark, result: dict[str, Any]) -> Path | None:
    """Where the picture of a result goes, or None for a result without held-out curves. The name carries
    the commit measured: a re-measured result gets a new picture, and the old one is left over (`draw`
    removes it; the test finds it)."""
    if not any(isinstance(c, dict) and c.get("curve") for c in result.get("cells") or []):
        return None
    return FIGURES / f"{machine}-{benchmark.name}-{str(result['commit'])[:7]}.png"


def pictures() -> dict[Path, tuple[catalog.Benchmark, Path]]:
    """Every picture the page shows, with the benchmark and result file it is drawn from."""
    shown = {}
    for machine, benchmark, path in result_files():
        picture = picture_for(machine, benchmark, resultfile.read(path))
        if picture is not None:
            shown[picture] = (benchmark, path)
    return shown


def picture_problems() -> list[str]:
    """A picture the page shows that is not drawn, or one in docs/figures that it no longer shows."""
    shown = pictures()
    drawn = set(FIGURES.glob("*.png")) if FIGURES.is_dir() else set()
    return ([f"{_shown_as(p)}: shown on the page, not drawn (python -m benchmarks render)"
             for p in sorted(set(shown) - drawn)]
            + [f"{_shown_as(p)}: drawn, shown by no current result" for p in sorted(drawn - set(shown))])


def _shown_as(picture: Path) -> str:
    """A picture's path from the repository root, as a reader finds it."""
    if picture.is_relative_to(resultfile.ROOT):
        return picture.relative_to(resultfile.ROOT).as_posix()
    return str(picture)


def draw(redraw: bool = False) -> list[Path]:
    """Draw the pictures the page shows that are missing (every one with `redraw`) and remove those it no
    longer shows; returns the ones drawn. Needs matplotlib (the `ui` extra)."""
    shown = pictures()
    FIGURES.mkdir(parents=True, exist_ok=True)
    for leftover in set(FIGURES.glob("*.png")) - set(shown):
        leftover.unlink()
    drawn = []
    for picture, (benchmark, path) in shown.items():
        if picture.exists() and not redraw:
            continue
        script = importlib.import_module(Path(benchmark.script).stem)
        if not hasattr(script, "draw"):
            raise RuntimeError(f"{path}: its cells hold held-out curves, but benchmarks/{benchmark.script} has no "
                               "draw(result, picture) to draw them")
        script.draw(path, picture)
        drawn.append(picture)
    return drawn


def render() -> str:
    """The whole page, from the result files alone."""
    lines = ["# Benchmarks", "",
             "Generated by `python -m benchmarks render` from `benchmarks/results/`; do not edit. Each section "
             "names the commit and machine its figures came from; `python -m benchmarks check` lists those "
             "whose measured code changed since. How each benchmark measures is said atop its script.", ""]
    files = result_files()
    for machine in dict.fromkeys(m for m, _, _ in files):
        lines += [f"## On `{machine}`", ""]
        for _, benchmark, path in (f for f in files if f[0] == machine):
            lines += _section(machine, benchmark, path)
    measured = {b.name for _, b, _ in files}
    absent = [b for b in catalog.BENCHMARKS if b.name not in measured]
    if absent:
        lines += ["## Not measured at this layout yet", ""]
        lines += [f"- `{b.name}`: {b.title} (`python -m benchmarks run --only {b.name}`)" for b in absent]
        lines.append("")
    older = older_files()
    if older:
        lines += ["## Older results", "",
                  f"{len(older)} files under `benchmarks/results/` predate this layout. The "
                  "[earlier measurements](earlier-measurements.md) page cites them; each goes once its "
                  "benchmark is measured again here.", ""]
    return "\n".join(lines).rstrip() + "\n"


def stale_results() -> list[tuple[Path, str, list[str]]]:
    """(file, its commit, files changed since under MEASURED) for every result measured on older code."""
    stale = []
    for _, benchmark, path in result_files():
        commit = str(resultfile.read(path).get("commit"))
        scripts = [f"benchmarks/{script}" for script in (benchmark.script, *benchmark.measures)]
        changed = subprocess.run(["git", "-C", str(resultfile.ROOT), "diff", "--name-only", commit, "HEAD", "--",
                                  *MEASURED, *scripts], capture_output=True, text=True)
        names = changed.stdout.split()
        if changed.returncode != 0 or names:
            stale.append((path, commit, names or [f"commit {commit[:7]} unknown here"]))
    return stale
