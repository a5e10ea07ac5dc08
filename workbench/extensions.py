"""Extension points: how the engine finds what other packages add to it, by entry-point group, never by
module name (the engine imports no UI; the UI registers itself here).

Groups, and what a name in them must point to:

- `workbench.display`, name `run`: a callable `make(run)` returning an object with `_repr_mimebundle_`.
  A `Run` shown in a notebook displays as that object, made on its first display and kept, so every
  display of a run is the same live view. The UI registers its control panel.
- `workbench.commands`, any name: a function `main(argv) -> exit code`, run as `workbench NAME ...`
  and imported only then. The UI registers `dashboard`.

The declarations live in `pyproject.toml` under `[project.entry-points."GROUP"]`. Installing the package
(`pip install -e .` for a checkout) copies them into its metadata, where `importlib.metadata` finds
them, as it finds any other installed package's. A source checkout whose installed metadata predates a
declaration (an editable install not redone since) reads it from its own `pyproject.toml` as well, so a
new entry point works before the reinstall; the installed metadata wins where both name one.
"""
from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path
from typing import Any

DISPLAY = "workbench.display"
COMMANDS = "workbench.commands"
DISTRIBUTION = "training-workbench"
SOURCE_TREE = Path(__file__).resolve().parent.parent  # the checkout, when the engine runs from one


def declared(group: str) -> dict[str, metadata.EntryPoint]:
    """Every entry point of `group`, by name: installed metadata, else this checkout's pyproject.toml."""
    installed = {entry.name: entry for entry in metadata.entry_points(group=group)}
    return {**_declared_in_checkout(group), **installed}


def load(group: str, name: str) -> Any | None:
    """The object declared as `name` in `group`, or None when none is. Raises ImportError when one is
    declared but its package, or a package it needs, is not installed."""
    entry = declared(group).get(name)
    return entry.load() if entry is not None else None


def _declared_in_checkout(group: str) -> dict[str, metadata.EntryPoint]:
    pyproject = SOURCE_TREE / "pyproject.toml"
    if not pyproject.is_file():
        return {}  # installed from a wheel: the metadata is all there is
    project = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {})
    if project.get("name") != DISTRIBUTION:
        return {}  # the engine sits inside someone else's project: its declarations are not ours
    return {name: metadata.EntryPoint(name, value, group)
            for name, value in project.get("entry-points", {}).get(group, {}).items()}
