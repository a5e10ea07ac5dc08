"""The engine/UI boundary: the engine names no UI module, the UI imports no private engine name, and
the UI reaches the engine through the entry points it declares in pyproject.toml (`workbench.extensions`).
No cluster, no browser."""
from __future__ import annotations

import ast
import re
import sys
import types
from importlib import metadata
from pathlib import Path

import pytest

from workbench import extensions
from workbench.cli import main as cli
from workbench.run.handle import Run

ROOT = Path(__file__).resolve().parents[2]
MODULE_PATH = re.compile(r"^widgets(\.\w+)*$")


def _imports(tree: ast.AST) -> list[tuple[str, list[str]]]:
    """(module, imported names) for every import statement, and for import_module/__import__ calls
    given a constant module name (names empty)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, [alias.name for alias in node.names]))
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")):
            found.append((node.args[0].value, []))
    return found


def _ui_names(source: str) -> list[str]:
    """UI modules a piece of engine code names: imported, or spelled as a module path in a string."""
    tree = ast.parse(source)
    named = [module for module, _ in _imports(tree) if module.split(".")[0] == "widgets"]
    named += [node.value for node in ast.walk(tree)
              if isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_PATH.match(node.value)]
    return named


def _private_engine_names(source: str) -> list[str]:
    """`workbench` names a piece of UI code imports that are private (a `_x` module or name)."""
    bad = []
    for module, names in _imports(ast.parse(source)):
        if module.split(".")[0] != "workbench":
            continue
        if any(part.startswith("_") for part in module.split(".")[1:]):
            bad.append(module)
        bad += [f"{module}.{name}" for name in names if name.startswith("_")]
    return bad


def test_the_scans_catch_what_they_look_for():
    assert _ui_names('importlib.import_module("widgets.control_panel")') == ["widgets.control_panel"] * 2
    assert _ui_names("from widgets.dashboard import serve") == ["widgets.dashboard"]
    assert _ui_names('"""the UI (`widgets`) is not imported"""') == []
    assert _private_engine_names("from workbench.cli.main import _OneLineParser, main") == ["workbench.cli.main._OneLineParser"]
    assert _private_engine_names("import workbench._internal") == ["workbench._internal"]


def test_the_engine_names_no_ui_module():
    named = {str(path.relative_to(ROOT)): _ui_names(path.read_text()) for path in (ROOT / "workbench").rglob("*.py")}
    assert {path: names for path, names in named.items() if names} == {}


def test_the_ui_imports_no_private_engine_name_and_not_the_command_line():
    for path in (ROOT / "widgets").rglob("*.py"):
        source = path.read_text()
        assert _private_engine_names(source) == [], path
        # The engine's command runs the UI's; the UI uses the shared helpers (workbench.cli.arguments).
        assert not [m for m, _ in _imports(ast.parse(source)) if m == "workbench.cli.main"], path


def test_the_ui_registers_its_display_and_command_in_pyproject():
    from widgets.control_panel import ControlPanel
    from widgets.dashboard import serve

    assert extensions.load(extensions.DISPLAY, "run") is ControlPanel
    assert extensions.load(extensions.COMMANDS, "dashboard") is serve.main
    assert extensions.load(extensions.COMMANDS, "no-such-command") is None


def test_installed_entry_points_come_first_and_the_checkout_fills_in(monkeypatch):
    module = types.ModuleType("fake_ui")
    module.show, module.serve = object(), object()
    monkeypatch.setitem(sys.modules, "fake_ui", module)
    installed = [metadata.EntryPoint("run", "fake_ui:show", extensions.DISPLAY),
                 metadata.EntryPoint("extra", "fake_ui:serve", extensions.COMMANDS)]
    monkeypatch.setattr(extensions.metadata, "entry_points",
                        lambda group: [entry for entry in installed if entry.group == group])
    assert extensions.load(extensions.DISPLAY, "run") is module.show
    assert set(extensions.declared(extensions.COMMANDS)) == {"dashboard", "extra"}
    # Installed from a wheel (no checkout beside the package): only the metadata counts.
    monkeypatch.setattr(extensions, "SOURCE_TREE", ROOT / "no-such-directory")
    assert set(extensions.declared(extensions.COMMANDS)) == {"extra"}


def test_a_run_displays_as_what_the_display_entry_point_makes_else_as_text(monkeypatch):
    class Shown:
        def __init__(self, run):
            self.run = run

        def _repr_mimebundle_(self, include=None, exclude=None):
            return {"text/html": "panel"}

    class Plain:
        _panel = None

        def __repr__(self):
            return "<Run>"

    monkeypatch.setattr(extensions, "load", lambda group, name: None)
    assert Run._repr_mimebundle_(Plain()) == {"text/plain": "<Run>"}

    def missing(group, name):
        raise ImportError("No module named 'ipywidgets'")

    monkeypatch.setattr(extensions, "load", missing)
    assert Run._repr_mimebundle_(Plain()) == {"text/plain": "<Run>"}
    monkeypatch.setattr(extensions, "load", lambda group, name: Shown if (group, name) == (extensions.DISPLAY, "run")
                        else None)
    run = Plain()
    assert Run._repr_mimebundle_(run) == {"text/html": "panel"}
    first = run._panel
    Run._repr_mimebundle_(run)
    assert run._panel is first and first.run is run  # made once: every display is the same live view


def test_added_commands_are_dispatched_with_their_arguments_or_say_what_is_missing(monkeypatch, capsys):
    calls = []

    def fake_load(group, name):
        if name == "broken":
            raise ImportError("No module named 'panel'")
        return lambda argv: calls.append(argv) or 7

    monkeypatch.setattr(extensions, "declared", lambda group: {"fake": None, "broken": None})
    monkeypatch.setattr(extensions, "load", fake_load)
    assert cli.main(["fake", "--x", "1"]) == 7 and calls == [["--x", "1"]]
    assert cli.main(["broken"]) == cli.EXIT_FAILED
    assert "workbench broken: needs the UI extra" in capsys.readouterr().err
