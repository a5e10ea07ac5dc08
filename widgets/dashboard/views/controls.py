"""The control bar: pause, resume, stop, learning rate and strategy switch for the picked run; the
switch's settings are a form made from the strategy's settings (`workbench.cli.setting_flags.form_fields`,
as the notebook panel's), starting from the run's own values when it is the run's strategy.

Every click is checked here, on the server, with `Access.may_control`: the buttons are disabled for
viewers, but a disabled button made clickable or a crafted websocket message ends in `act` all the same
and is refused there. Requests go to the run's owner through the hub; the run answers under "Control
requests" (Run details).
"""
from __future__ import annotations

import json
import logging
from typing import Any

import panel as pn

from workbench.cli.setting_flags import FormField, form_fields, parse_optional
from workbench.job import check_lr
from workbench.run.autopilot import AUTO, check_no_settings
from workbench.strategies import STRATEGIES, make_settings

from ..hub import ENDED
from .common import Context

logger = logging.getLogger("workbench.dashboard")


class Controls:
    """The buttons and inputs that act on the picked run, enabled only for who may control it."""

    scope = "run"  # drawn when the picked run's view changed

    def __init__(self, context: Context) -> None:
        self.context = context
        self.pause_button = pn.widgets.Button(label="Pause", color="warning", width=90)
        self.resume_button = pn.widgets.Button(label="Resume", color="success", width=90)
        self.stop_button = pn.widgets.Button(label="Stop", color="danger", width=90)
        self.lr_input = pn.widgets.FloatInput(label="Learning rate", value=0.01, step=0.001, start=0, width=130)
        self.lr_button = pn.widgets.Button(label="Set learning rate", width=140)
        # 'auto' too: switching to it lets `auto` choose (again, after a pin).
        self.strategy_select = pn.widgets.Select(label="Strategy", options=list(STRATEGIES) + [AUTO], width=120)
        self.settings_form = SettingsForm()
        self.settings_form.show(self.strategy_select.value)
        self.strategy_select.param.watch(lambda event: self.settings_form.show(event.new, self._run_settings(event.new)),
                                         "value")
        self._shown_for: tuple[str | None, str | None] = (None, None)  # (run, strategy) the form was filled for
        self.switch_button = pn.widgets.Button(label="Switch strategy", color="primary", width=140)
        # A run started with strategy='auto' changes strategy by itself; this keeps the current one.
        self.pin_button = pn.widgets.Button(label="Pin strategy", width=120)
        self.message = pn.pane.Markdown("", css_classes=["control-message"])
        self.pause_button.on_click(lambda _: self.act("pause"))
        self.resume_button.on_click(lambda _: self.act("resume"))
        self.stop_button.on_click(lambda _: self.act("stop"))
        self.lr_button.on_click(lambda _: self.act("set_lr", lr=self.lr_input.value))
        self.switch_button.on_click(lambda _: self.act("switch", strategy=self.strategy_select.value,
                                                       settings=self.settings_form.values()))
        self.pin_button.on_click(lambda _: self.act("pin"))
        self.buttons = (self.pause_button, self.resume_button, self.stop_button, self.lr_button, self.switch_button,
                        self.pin_button)
        self.layout = pn.Column(
            pn.Row(self.pause_button, self.resume_button, self.stop_button, self.lr_input, self.lr_button,
                   self.strategy_select, self.switch_button, self.pin_button),
            self.settings_form.layout, self.message, sizing_mode="stretch_width")

    def _run_settings(self, strategy: str) -> dict[str, Any]:
        """The picked run's current settings when it trains with `strategy` (else the defaults)."""
        run_id = self.context.selected()
        feed = self.context.hub.feed(run_id) if run_id else None
        info = feed.info if feed is not None else {}
        return dict(info.get("settings") or {}) if info.get("strategy") == strategy else {}

    def draw(self, view: dict[str, Any], force: bool) -> None:
        """Enable the buttons for who may control the run, while it has not ended (a courtesy: `act` decides)."""
        info = view["info"]
        owner = info.get("owner")
        picked = (self.context.selected(), info.get("strategy"))
        if picked != self._shown_for and picked[1] in STRATEGIES:  # another run, or it switched: its values
            self._shown_for = picked
            if self.strategy_select.value == picked[1]:
                self.settings_form.show(picked[1], dict(info.get("settings") or {}))
            else:
                self.strategy_select.value = picked[1]  # the watcher fills the form with the run's values
        allowed = self.context.access.may_control(self.context.user, owner) and view["status"] not in ENDED
        for button in self.buttons:
            usable = allowed and (button is not self.pin_button or bool(info.get("auto")))
            if button.disabled == usable:
                button.disabled = not usable

    def act(self, action: str, **arguments: Any) -> bool:
        """Send a control request for the picked run, if this session's user may; True when sent.

        Runs on the server for every click, whatever the browser shows or sends: a disabled button
        made clickable, or a crafted websocket message, ends here and is refused the same way.
        """
        hub, access, user = self.context.hub, self.context.access, self.context.user
        run_id = self.context.selected()
        feed = hub.feed(run_id) if run_id else None
        if feed is None:
            return self._say(f"{action}: no run selected", refused=True)
        owner = feed.info.get("owner")
        if not access.may_control(user, owner):
            logger.warning("refused %s on run %s for %s (role %s)", action, run_id, user or "anonymous",
                           access.role(user, owner))
            return self._say(f"refused: {action} needs the run's owner ({owner}) or an admin; you are "
                             f"{user or 'not signed in'} ({access.role(user, owner)})", refused=True)
        if feed.status in ENDED:
            return self._say(f"refused: run {run_id} has ended ({feed.status})", refused=True)
        try:
            arguments = checked(action, arguments)
        except (ValueError, TypeError) as error:
            return self._say(f"{action}: {error}", refused=True)
        hub.request(run_id, action, user, **arguments)
        return self._say(f"sent {action} to run {run_id}; its answer appears under Control requests")

    def _say(self, text: str, refused: bool = False) -> bool:
        self.message.object = ("⛔ " if refused else "✔ ") + text
        return not refused


def checked(action: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """Refuse bad values here, with the engine's own messages, before bothering the run."""
    if action == "set_lr":
        return {"lr": check_lr(arguments["lr"])}
    if action == "switch":
        text = arguments.get("settings") or "{}"
        try:
            settings = json.loads(text) if isinstance(text, str) else dict(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"settings={text!r} is not allowed: expected a JSON object ({error})") from None
        if not isinstance(settings, dict):
            raise ValueError(f"settings={text!r} is not allowed: expected a JSON object")
        if arguments["strategy"] == AUTO:
            check_no_settings(settings)  # a ConfigError is a ValueError: refused like the others
        else:
            make_settings(arguments["strategy"], settings)
        return {"strategy": arguments["strategy"], "settings": settings}
    return {}


class SettingsForm:
    """A strategy's settings as widgets of the kind each takes: a checkbox, a choice, a number, or a text
    box for an optional number (empty: the strategy's default behaviour)."""

    def __init__(self) -> None:
        self.layout = pn.FlexBox(sizing_mode="stretch_width")
        self.widgets: dict[str, Any] = {}
        self.strategy: str | None = None

    def show(self, strategy: str, values: dict[str, Any] | None = None) -> None:
        values = values or {}
        self.strategy = strategy
        self.widgets = {} if strategy == AUTO else {  # auto takes no settings: it picks them
            field.name: setting_widget(field, values.get(field.name, field.value)) for field in form_fields(strategy)}
        self.layout.objects = list(self.widgets.values())

    def values(self) -> dict[str, Any]:
        """The settings as the strategy takes them (checked by `checked` before anything is sent)."""
        return {name: parse_optional(widget.value) if isinstance(widget, pn.widgets.TextInput) else widget.value
                for name, widget in self.widgets.items()}


def setting_widget(field: FormField, value: Any) -> Any:
    """The Panel widget for one setting, of the kind `form_fields` says (the notebook panel's too)."""
    if field.kind == "bool":  # a checkbox has no hover help in Panel
        return pn.widgets.Checkbox(value=bool(value), label=field.name, width=170)
    common = {"label": field.name, "width": 150, "description": field.help or None}
    if field.kind == "choice":
        return pn.widgets.Select(options=dict(field.options), value=value, **common)
    if field.kind == "int":
        return pn.widgets.IntInput(value=value, **common)
    if field.kind == "float":
        return pn.widgets.FloatInput(value=value, **common)
    return pn.widgets.TextInput(value="" if value is None else str(value), placeholder="default", **common)
