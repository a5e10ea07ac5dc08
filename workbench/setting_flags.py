"""Command-line flags for every strategy setting, made from the settings dataclasses themselves.

One source of truth: a setting added to a strategy's dataclass is a flag of `workbench train` at once,
with its type, its default and the first sentence of its docstring as help. Values are checked by the
strategy's own `validate` (through `make_settings`), so the CLI and the Python API refuse the same
values with the same message.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
import types
import typing
from typing import Any

from .strategies import STRATEGIES


def setting_fields() -> dict[str, dict[str, Any]]:
    """Every setting of every registered strategy: name -> {type, strategies, help}, in a stable order."""
    fields: dict[str, dict[str, Any]] = {}
    for name in sorted(STRATEGIES):
        settings_class = STRATEGIES[name].settings_class
        hints = typing.get_type_hints(settings_class)
        docs = _attribute_docs(settings_class)
        for field in dataclasses.fields(settings_class):
            entry = fields.setdefault(field.name, {"type": _plain_type(hints[field.name]), "strategies": [],
                                                   "help": docs.get(field.name, "")})
            entry["strategies"].append(name)
    return fields


def add_setting_flags(parser: argparse.ArgumentParser) -> None:
    """`--period`, `--push-every`, ... (default None: the strategy's own default)."""
    for name, field in setting_fields().items():
        used_by = ", ".join(f"'{s}'" for s in field["strategies"])
        help_text = f"{field['help']} ({used_by})" if field["help"] else f"a setting of {used_by}"
        flag = "--" + name.replace("_", "-")
        if field["type"] is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            parser.add_argument(flag, type=field["type"], default=None, help=help_text)


def chosen_settings(arguments: argparse.Namespace) -> dict[str, Any]:
    """The settings given on the command line (the strategy checks they are its own)."""
    return {name: getattr(arguments, name) for name in setting_fields() if getattr(arguments, name) is not None}


def _plain_type(annotation: Any) -> type:
    """int for `int` and `int | None`; the same for float, bool and str."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    return annotation


def _attribute_docs(settings_class: type) -> dict[str, str]:
    """The first sentence of each field's docstring (a string right after the field), base classes too."""
    docs: dict[str, str] = {}
    for klass in reversed(settings_class.__mro__):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for statement, following in zip(body, body[1:]):
            if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name) \
                    and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant) \
                    and isinstance(following.value.value, str):
                text = " ".join(following.value.value.split())
                docs[statement.target.id] = text.split(". ")[0].rstrip(".")
    return docs
