"""What the `cpn` command modules share (cpn.cli and each cpn/<group>_cli.py): UsageError and
the parser class, which make a user's error exit 2 with one line; the --etcd and --broker
options; and the registry, PKI and device catalog that a command's options name.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import NoReturn, Protocol

from cpn.certs import Pki
from cpn.state import read_up_state
from sites.model.catalog import DeviceCatalog
from sites.registry.client import Registry, parse_endpoints
from sites.registry.security import CREDENTIALS_ENV, EtcdTls, load_credentials

__all__ = [
    "BrokerArg",
    "CliParser",
    "UsageError",
    "broker_arg",
    "catalog_of",
    "etcd_access",
    "etcd_arg",
    "etcd_url",
    "pki_of",
    "registry_of",
]


class UsageError(Exception):
    """Bad input from the user: exit 2."""


class CliParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        print(f"cpn: error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        raise SystemExit(2)


# -- options -------------------------------------------------------------------------------


def etcd_arg(p: argparse.ArgumentParser) -> None:
    """--etcd, --etcd-credentials and --catalog: a command that reads or writes the registry."""
    p.add_argument(
        "--etcd",
        metavar="URL[,URL...]",
        help="etcd endpoints (default: $CPN_ETCD, else the etcd of a running `cpn up`)",
    )
    p.add_argument(
        "--etcd-credentials",
        metavar="FILE",
        help="credential file for an etcd with TLS and auth (default: "
        "$CPN_ETCD_CREDENTIALS; docs/auth.md)",
    )
    p.add_argument("--catalog", metavar="FILE", help="device catalog (configs/devices.yaml)")


def broker_arg(p: argparse.ArgumentParser, outputs: tuple[str, ...] = ("table", "json")) -> None:
    """--broker and -o: a command that asks a broker's API."""
    p.add_argument("--broker", metavar="URL", help="broker API (default: $CPN_BROKER or cpn up's)")
    p.add_argument("-o", "--output", choices=outputs, default="table")


class BrokerArg(Protocol):
    """`broker_arg`'s type, as a command module's add_parsers takes it."""

    def __call__(self, p: argparse.ArgumentParser, outputs: tuple[str, ...] = ...) -> None: ...


# -- what the options name -----------------------------------------------------------------


def etcd_url(args: argparse.Namespace) -> str:
    url: str | None = args.etcd or os.environ.get("CPN_ETCD")
    if not url:
        state = read_up_state()
        url = state.get("etcd") if state else None
    if not url:
        raise UsageError("no etcd: pass --etcd URL[,URL...], set CPN_ETCD, or start `cpn up`")
    try:
        parse_endpoints(url)
    except ValueError as exc:
        raise UsageError(f"--etcd: {exc}") from None
    return url


def etcd_access(args: argparse.Namespace) -> tuple[str, EtcdTls | None]:
    """The etcd URL and TLS material: a credential file (--etcd-credentials, else
    $CPN_ETCD_CREDENTIALS, else the running `cpn up --secure`'s root one) names both."""
    path = getattr(args, "etcd_credentials", None) or os.environ.get(CREDENTIALS_ENV)
    if not path and not (args.etcd or os.environ.get("CPN_ETCD")):
        state = read_up_state()
        path = state.get("etcd_credentials") if state else None
    if not path:
        return etcd_url(args), None
    creds = load_credentials(Path(path))  # its endpoints are checked with it
    return (etcd_url(args) if args.etcd else creds.endpoints), creds.tls()


def registry_of(args: argparse.Namespace) -> Registry:
    url, tls = etcd_access(args)
    return Registry.from_urls(url, tls=tls)


def pki_of(args: argparse.Namespace) -> Pki:
    from cpn.secure import default_pki_dir

    return Pki(Path(args.certs) if getattr(args, "certs", None) else default_pki_dir())


def catalog_of(args: argparse.Namespace) -> DeviceCatalog:
    path = Path(args.catalog) if getattr(args, "catalog", None) else None
    return DeviceCatalog.load(path)
