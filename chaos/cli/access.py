"""The flags every command that talks to a target shares: its API key, headers and TLS.

They mirror the campaign's `target.api_key_env`, `headers`, `header_env`, `ca_bundle` and
`insecure` (chaos/targets/spec.py), and on `run` override them. The key itself is never a flag: a
flag lands in shell history and `ps`; the flag names the environment variable that holds it.
"""

from __future__ import annotations

import argparse
from typing import Any

from chaos import transport
from chaos.errors import UsageError
from chaos.targets.spec import ENV_NAME
from chaos.transport import Transport, looks_secret, parse_header


def add_access_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("credentials and TLS (the key itself is never a flag)")
    group.add_argument(
        "--api-key-env",
        metavar="VAR",
        default=None,
        help="environment variable holding the API key, sent as 'Authorization: Bearer <key>'",
    )
    group.add_argument(
        "--header",
        action="append",
        default=[],
        metavar="'NAME: VALUE'",
        help="an extra header on every request (repeat); not for secrets, which --header-env takes",
    )
    group.add_argument(
        "--header-env",
        action="append",
        default=[],
        metavar="NAME=VAR",
        help="a header whose secret value is in environment variable VAR (repeat)",
    )
    group.add_argument("--ca-bundle", default=None, metavar="PEM", help="trust this CA for https:// targets")
    group.add_argument(
        "--insecure", action="store_true", help="https:// without certificate verification (never the default)"
    )


def access_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The flags given, as `target:` fields of a campaign (for `run`)."""
    out: dict[str, Any] = {}
    if args.api_key_env is not None:
        out["api_key_env"] = _variable(args.api_key_env, "--api-key-env")
    headers = dict(parse_header(h) for h in args.header)
    for name in headers:
        if looks_secret(name):
            raise UsageError(f"--header {name}: looks like a credential; give it as --header-env '{name}=VARIABLE'")
    if headers:
        out["headers"] = headers
    header_env = dict(_header_env(h) for h in args.header_env)
    if header_env:
        out["header_env"] = header_env
    if args.ca_bundle is not None:
        out["ca_bundle"] = args.ca_bundle
    if args.insecure:
        out["insecure"] = True
    if out.get("ca_bundle") and out.get("insecure"):
        raise UsageError("give --ca-bundle (verify against that CA) or --insecure (no verification), not both")
    return out


def configure_from_args(args: argparse.Namespace) -> Transport:
    """For commands given a URL (`load`, `canary`, `preflight --url`): the flags become this
    process's transport, and every variable they name must be set."""
    fields = access_overrides(args)
    chosen = Transport(
        api_key_env=fields.get("api_key_env"),
        headers=tuple(fields.get("headers", {}).items()),
        header_env=tuple(fields.get("header_env", {}).items()),
        ca_bundle=fields.get("ca_bundle"),
        insecure=bool(fields.get("insecure", False)),
    )
    chosen.check_variables()
    transport.configure(chosen)
    return chosen


def _variable(name: str, flag: str) -> str:
    if not ENV_NAME.fullmatch(name):
        raise UsageError(f"{flag} names an environment variable (e.g. PDCHAOS_API_KEY), not the key itself")
    return name


def _header_env(text: str) -> tuple[str, str]:
    name, sep, variable = text.partition("=")
    if not sep or not name.strip():
        raise UsageError(f"--header-env {text!r}: write it as NAME=VARIABLE, e.g. --header-env 'X-Api-Key=GATEWAY_KEY'")
    return name.strip(), _variable(variable.strip(), f"--header-env {name.strip()}")
