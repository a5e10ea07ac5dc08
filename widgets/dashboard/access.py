"""Who may do what on the team dashboard: pure rules, checked on the server for every control action.

Without sign-in (the default, on localhost) everyone sees everything, and may control runs only when
the dashboard listens on a loopback address (where "everyone" is the person at this machine). With
sign-in (basic auth or OAuth), anonymous users get the login page and nothing else; signed-in users see
everything; a run's owner and the listed admins may pause, resume, stop, change the learning rate and
switch the strategy. Hiding buttons is a courtesy; these checks are the rule.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import json
from pathlib import Path

from workbench.errors import ConfigError

ROLES = ("anonymous", "viewer", "owner", "admin", "operator")
CONTROLLING_ROLES = ("owner", "admin", "operator")  # operator: anyone, on an open loopback dashboard


@dataclasses.dataclass(frozen=True)
class Access:
    """The dashboard's access policy."""

    sign_in: bool = False  # users sign in (basic auth or OAuth)
    admins: frozenset[str] = frozenset()  # users who may control every run
    open_control: bool = False  # without sign-in: may anyone control runs? (loopback only)

    def role(self, user: str | None, owner: str | None) -> str:
        """The role of `user` (None when not signed in) towards a run owned by `owner`."""
        if not self.sign_in:
            return "operator" if self.open_control else "viewer"
        if not user:
            return "anonymous"
        if user in self.admins:
            return "admin"
        if owner is not None and user == owner:
            return "owner"
        return "viewer"

    def may_control(self, user: str | None, owner: str | None) -> bool:
        return self.role(user, owner) in CONTROLLING_ROLES


def policy(sign_in: bool, admins: list[str] | tuple[str, ...] | None, address: str | None) -> Access:
    """The policy for a dashboard listening on `address` (None: localhost)."""
    return Access(sign_in=sign_in, admins=frozenset(a.strip() for a in admins or () if a.strip()),
                  open_control=not sign_in and is_loopback(address))


def is_loopback(address: str | None) -> bool:
    if address in (None, "", "localhost"):
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False  # a host name other than localhost: assume it is reachable from elsewhere


def load_credentials(path: str | Path) -> dict[str, str]:
    """A basic-auth credentials file: a JSON object {"user": "password", ...}."""
    try:
        credentials = json.loads(Path(path).read_text())
    except OSError as error:
        raise ConfigError("--basic-auth", str(path), "a readable JSON file of {\"user\": \"password\"}",
                          f"{type(error).__name__}: {error.strerror or error}") from None
    except json.JSONDecodeError as error:
        raise ConfigError("--basic-auth", str(path), "a JSON file of {\"user\": \"password\"}",
                          f"it is not JSON: {error}") from None
    if (not isinstance(credentials, dict) or not credentials
            or not all(isinstance(k, str) and k and isinstance(v, str) and v for k, v in credentials.items())):
        raise ConfigError("--basic-auth", str(path), "a non-empty JSON object of user name to password strings")
    return credentials
