"""The control bar: pause, resume, stop, learning rate and strategy switch for the picked run.

Every click is checked here, on the server, with `Access.may_control`: the buttons are disabled for
viewers, but a disabled button made clickable or a crafted websocket message ends in `act` all the same
and is refused there. Requests go to the run's owner through the hub; the run answers under "Control
requests" (Run details).
"""
from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

import panel as pn

from workbench.job import check_lr
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
        self.strategy_select = pn.widgets.Select(label="Strategy", options=list(STRATEGIES), width=120)
        self.settings_input = pn.widgets.TextInput(label="Settings (JSON)", value=settings_json(next(iter(STRATEGIES))),
                                                   width=260)
        self.strategy_select.param.watch(lambda event: setattr(self.settings_input, "value", settings_json(event.new)),
                                         "value")
        self.switch_button = pn.widgets.Button(label="Switch strategy", color="primary", width=140)
        # A run started with strategy='auto' changes strategy by itself; this keeps the current one.
        self.pin_button = pn.widgets.Button(label="Pin strategy", width=120)
        self.message = pn.pane.Markdown("", css_classes=["control-message"])
        self.pause_button.on_click(lambda _: self.act("pause"))
        self.resume_button.on_click(lambda _: self.act("resume"))
        self.stop_button.on_click(lambda _: self.act("stop"))
        self.lr_button.on_click(lambda _: self.act("set_lr", lr=self.lr_input.value))
        self.switch_button.on_click(lambda _: self.act("switch", strategy=self.strategy_select.value,
                                                       settings=self.settings_input.value))
        self.pin_button.on_click(lambda _: self.act("pin"))
        self.buttons = (self.pause_button, self.resume_button, self.stop_button, self.lr_button, self.switch_button,
                        self.pin_button)
        self.layout = pn.Column(
            pn.Row(self.pause_button, self.resume_button, self.stop_button, self.lr_input, self.lr_button,
                   self.strategy_select, self.settings_input, self.switch_button, self.pin_button),
            self.message, sizing_mode="stretch_width")

    def draw(self, view: dict[str, Any], force: bool) -> None:
        """Enable the buttons for who may control the run, while it has not ended (a courtesy: `act` decides)."""
        owner = view["info"].get("owner")
        allowed = self.context.access.may_control(self.context.user, owner) and view["status"] not in ENDED
        for button in self.buttons:
            usable = allowed and (button is not self.pin_button or bool(view["info"].get("auto")))
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
        make_settings(arguments["strategy"], settings)
        return {"strategy": arguments["strategy"], "settings": settings}
    return {}


def settings_json(strategy: str) -> str:
    """A strategy's default settings as JSON, to start the switch form from."""
    return json.dumps(dataclasses.asdict(make_settings(strategy, {})))
