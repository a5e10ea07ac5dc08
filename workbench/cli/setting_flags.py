"""Command-line flags and form fields for every strategy setting, made from the settings dataclasses.

One source of truth: a setting added to a strategy's dataclass is a flag of `workbench train` at once,
with its type, its default and the first sentence of its docstring as help. Values are checked by the
strategy's own `validate` (through `make_settings`), so the CLI and the Python API refuse the same
values with the same message. `form_fields` describes the same settings for the notebook panel's and the
dashboard's forms (which widget, which choices), so that both offer every setting the same way.
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

from workbench.comm.averaging import WIRE_DTYPES
from workbench.comm.sparse_outer import BITS
from workbench.server.compression import COMPRESSIONS
from workbench.strategies import STRATEGIES, get_strategy

# Settings whose values are a fixed set: a form offers them as a choice, as (label, value) pairs.
CHOICES: dict[str, tuple[tuple[str, Any], ...]] = {
    "compression": tuple((c, c) for c in COMPRESSIONS),
    "reply_compression": (("as compression", None),) + tuple((c, c) for c in COMPRESSIONS),
    "wire_dtype": tuple((d, d) for d in WIRE_DTYPES),
    "sparse_bits": tuple((str(b), b) for b in BITS),
}


@dataclasses.dataclass(frozen=True)
class FormField:
    """One strategy setting as a form shows it."""

    name: str
    kind: str  # "bool", "choice" (one of `options`), "int", "float", or "optional": a number, empty for None
    value: Any  # the strategy's default
    options: tuple[tuple[str, Any], ...] = ()
    help: str = ""


def form_fields(strategy: str) -> list[FormField]:
    """The settings of `strategy` in declaration order, each with the widget kind that fits it."""
    settings_class = get_strategy(strategy).settings_class
    hints = typing.get_type_hints(settings_class)
    docs = _attribute_docs(settings_class)
    defaults = dataclasses.asdict(settings_class())
    fields = []
    for field in dataclasses.fields(settings_class):
        hint = hints[field.name]
        optional = type(None) in typing.get_args(hint)
        plain = _plain_type(hint)
        if field.name in CHOICES:
            kind = "choice"
        elif plain is bool:
            kind = "bool"
        elif optional:
            kind = "optional"
        else:
            kind = "int" if plain is int else "float"
        fields.append(FormField(field.name, kind, defaults[field.name], CHOICES.get(field.name, ()),
                                docs.get(field.name, "")))
    return fields


def parse_optional(text: str) -> Any:
    """An optional number typed in a form: empty is None (the default behaviour), else the number, else
    the text as typed, for the strategy's own check to name the setting and what it allows."""
    text = text.strip()
    if not text:
        return None
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


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
