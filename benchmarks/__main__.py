"""One command for the benchmarks: run them, render their page, say which results are out of date.

    python -m benchmarks run [--suite quick|cpu|lab|gpu] [--only NAME[,NAME]] [--allow-dirty]
    python -m benchmarks render [--redraw]  # docs/benchmarks.md and docs/figures/ from benchmarks/results/
    python -m benchmarks check           # results whose measured code changed since their commit
    python -m benchmarks list

`run` starts each benchmark's script with `--out benchmarks/results/<machine class>/<name>.json` (the
`quick` suite writes to `benchmarks/scratch/`, which nothing reads), refuses a tree with uncommitted changes
(a result names the commit it measured; `--allow-dirty` runs anyway and the file says `dirty: true`), and
skips a benchmark whose needs (the lab: root, `ip`, `tc`; a GPU) this machine lacks, saying why. Where the
tree is no git clone (the GPU machine's copy), `COMMIT=<sha> DIRTY=false` name what it is a copy of.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the scripts import each other by their file names, as when run directly

import catalog  # noqa: E402
import pages  # noqa: E402
import resultfile  # noqa: E402

SCRATCH = HERE / "scratch"


def missing_needs(benchmark: catalog.Benchmark) -> str | None:
    """Why this machine cannot run `benchmark`, or None."""
    if benchmark.needs == "lab":
        sys.path.insert(0, str(resultfile.ROOT))
        from testbed import lab

        return lab.available()
    if benchmark.needs == "gpu":
        import torch

        return None if torch.cuda.is_available() else "no CUDA device here"
    return None


def run(arguments: argparse.Namespace) -> int:
    chosen = catalog.in_suite(arguments.suite)
    if arguments.only:
        names = arguments.only.split(",")
        unknown = [n for n in names if n not in catalog.BY_NAME]
        if unknown:
            sys.exit(f"--only {','.join(unknown)}: no such benchmark; one of {', '.join(catalog.BY_NAME)}")
        chosen = [catalog.BY_NAME[n] for n in names]
    quick = arguments.suite == "quick"
    # resultfile.commit() says, as every result file will: from git, or as COMMIT/DIRTY say where the tree is
    # no git clone (the GPU machine's copy; benchmarks/gpu_check.sh).
    if not quick and not arguments.allow_dirty and resultfile.commit()["dirty"] is True:
        sys.exit("the tree has uncommitted changes: a result must name the commit it measured. Commit first, "
                 "or pass --allow-dirty (the result then says dirty: true)")
    failed = []
    for benchmark in chosen:
        reason = missing_needs(benchmark)
        if reason:
            print(f"[benchmarks] skipped {benchmark.name}: {reason}", flush=True)
            continue
        out = SCRATCH / resultfile.machine_class() / f"{benchmark.name}.json" if quick else resultfile.path_for(benchmark.name)
        args = list(benchmark.args) + (list(benchmark.quick_args or ()) if quick else [])
        command = [sys.executable, str(HERE / benchmark.script), *args, "--out", str(out)]
        print(f"[benchmarks] {benchmark.name}: {' '.join(command[1:])}", flush=True)
        if subprocess.run(command, cwd=resultfile.ROOT).returncode != 0:
            failed.append(benchmark.name)
        elif not quick:
            missing = [key for key in benchmark.headline if key not in resultfile.read(out)]
            if missing:
                print(f"[benchmarks] {benchmark.name}: the result lacks {', '.join(missing)}", flush=True)
                failed.append(benchmark.name)
    if failed:
        print(f"[benchmarks] failed: {', '.join(failed)}")
    elif not quick:
        print("[benchmarks] done; python -m benchmarks render updates docs/benchmarks.md")
    return 1 if failed else 0


def check(_arguments: argparse.Namespace) -> int:
    """Print every result whose measured code (the engine, the testbed, the benchmark scripts) changed
    since the commit it names."""
    stale = pages.stale_results()
    for path, commit, changed in stale:
        print(f"{path.relative_to(resultfile.ROOT)}: measured {commit[:7]}; since then {len(changed)} file(s) "
              f"changed, e.g. {', '.join(changed[:3])}")
    print(f"{len(stale)} result(s) out of date" if stale else "every result is current")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    runner = commands.add_parser("run", help="run benchmarks and write their results")
    runner.add_argument("--suite", default="cpu", choices=catalog.SUITES)
    runner.add_argument("--only", default=None, help="comma-separated benchmark names (any suite)")
    runner.add_argument("--allow-dirty", action="store_true")
    renderer = commands.add_parser("render", help="write docs/benchmarks.md and its pictures from the result files")
    renderer.add_argument("--redraw", action="store_true", help="draw every picture again, not only missing ones")
    commands.add_parser("check", help="list results whose measured code changed since their commit")
    commands.add_parser("list", help="every benchmark, its suites and needs")
    arguments = parser.parse_args()
    if arguments.command == "run":
        return run(arguments)
    if arguments.command == "render":
        pages.PAGE.write_text(pages.render())
        print(f"wrote {pages.PAGE.relative_to(resultfile.ROOT)}")
        pages.draw(redraw=arguments.redraw)  # each script's draw says what it drew
        return 0
    if arguments.command == "check":
        return check(arguments)
    for benchmark in catalog.BENCHMARKS:
        print(f"{benchmark.name:<20} {','.join(benchmark.suites):<10} {benchmark.needs or '-':<5} {benchmark.title}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
