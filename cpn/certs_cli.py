"""`cpn certs init|issue|ls|rotate|revoke`, `cpn etcd secure`: a development CA with its
certificates (cpn.certs), their renewal and revocation (cpn.rotation), and auth turned on in an
etcd that serves TLS (cpn.secure); docs/auth.md, docs/security.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from collections.abc import Callable
from typing import TYPE_CHECKING

from cpn.certs import DEFAULT_HOSTS, RENEW_WITHIN_DAYS, Pki
from cpn.cli_base import CliParser, UsageError, etcd_arg, etcd_url, pki_of, registry_of

if TYPE_CHECKING:
    from cpn.rotation import Held

__all__ = [
    "add_parsers",
    "cmd_certs_init",
    "cmd_certs_issue",
    "cmd_certs_ls",
    "cmd_certs_revoke",
    "cmd_certs_rotate",
    "cmd_etcd_secure",
]


def cmd_certs_init(args: argparse.Namespace) -> int:
    from cpn.secure import init_pki

    pki = pki_of(args)
    created = pki.init()
    tls = init_pki(pki, args.host)
    print(f"{'created' if created else 'kept'} the CA {pki.ca_path}")
    print(f"etcd: --cert-file {tls.cert_file} --key-file {tls.key_file} ", end="")
    print(f"--trusted-ca-file {tls.ca_file} --client-cert-auth --client-crl-file {tls.crl_file}")
    print(f"broker: --tls-cert {pki.directory / 'broker.pem'} --tls-key ", end="")
    print(f"{pki.directory / 'broker-key.pem'}")
    return 0


def cmd_certs_issue(args: argparse.Namespace) -> int:
    pki = pki_of(args)
    issued = pki.issue(args.name, hosts=args.host or DEFAULT_HOSTS, server=args.server)
    print(f"{issued.cert_path} {issued.key_path}")
    return 0


def _held_pki(args: argparse.Namespace) -> Pki:
    """The directory `ls`, `rotate` and `revoke` work on: --dir, else $CPN_CERTS, else the
    running `cpn up --secure`'s (its run's pki/), else the state directory's pki/."""
    import os
    from pathlib import Path

    from cpn.secure import CERTS_ENV
    from cpn.state import read_up_state

    if not getattr(args, "certs", None) and not os.environ.get(CERTS_ENV):
        state = read_up_state()
        if state and state.get("ca"):
            return Pki(Path(state["ca"]).parent)
    return pki_of(args)


def _within(args: argparse.Namespace) -> dt.timedelta:
    if args.within < 0:
        raise UsageError(f"--within: {args.within} days; expected 0 or more")
    return dt.timedelta(days=args.within)


def _day(when: dt.datetime) -> str:
    return when.strftime("%Y-%m-%d %H:%M")


def cmd_certs_ls(args: argparse.Namespace) -> int:
    from cryptography import x509

    from cpn.rotation import held

    pki = _held_pki(args)
    now = dt.datetime.now(dt.UTC)
    within = _within(args)
    revoked = set(pki.revoked())
    certs = held(pki)
    rows = [
        {
            "name": c.name,
            "common_name": c.common_name,
            "serial": f"{c.serial:x}",
            "not_after": c.not_after.isoformat(),
            "days_left": (c.not_after - now).days,
            "state": c.state(now, revoked, within),
        }
        for c in certs
    ]
    crl = pki.crl()
    crl_next = None if crl is None or crl.next_update_utc is None else crl.next_update_utc
    ca_expires = x509.load_pem_x509_certificate(pki.ca_pem()).not_valid_after_utc
    if args.output == "json":
        doc = {
            "ca": {"not_after": ca_expires.isoformat(), "days_left": (ca_expires - now).days},
            "certificates": rows,
            "crl": None
            if crl is None
            else {"next_update": crl_next and crl_next.isoformat(), "revoked": len(revoked)},
        }
        print(json.dumps(doc, indent=2))
        return 0
    print(f"{'NAME':<28} {'COMMON NAME':<24} {'NOT AFTER':<17} {'DAYS':>5}  STATE")
    for c, row in zip(certs, rows, strict=True):
        print(
            f"{c.name:<28} {c.common_name:<24} {_day(c.not_after):<17} "
            f"{row['days_left']:>5}  {row['state']}"
        )
    ca_state = "due: not renewed by rotate" if ca_expires <= now + within else "ok"
    print(
        f"CA {pki.ca_path}: until {_day(ca_expires)} ({(ca_expires - now).days} days), {ca_state}"
    )
    if crl is None:
        print("no CRL: nothing revoked (`cpn certs rotate` writes one)")
    else:
        nxt = "-" if crl_next is None else _day(crl_next)
        print(f"CRL {pki.crl_path}: {len(revoked)} revoked, next update {nxt}")
    return 0


async def _publish(args: argparse.Namespace, pki: Pki) -> None:
    """Put the CRL in etcd, where every broker and agent follows it (sites.registry.crl)."""
    from sites.registry.crl import publish_crl

    async with registry_of(args) as registry:
        await publish_crl(registry, pki.crl_path.read_bytes())
        print(f"published the CRL at {registry.url}")


async def cmd_certs_rotate(args: argparse.Namespace) -> int:
    from cpn.rotation import rotate

    pki = _held_pki(args)
    report = rotate(pki, now=dt.datetime.now(dt.UTC), within=_within(args), dry_run=args.dry_run)
    for old, new in report.renewed:
        if new is None:
            print(f"would renew {old.name} (expires {_day(old.not_after)})")
        else:
            print(f"renewed {old.name}: until {_day(new.not_after)} (was {_day(old.not_after)})")
    if not report.renewed:
        print(f"nothing expires within {args.within} days")
    if report.crl_signed:
        print(f"{'would sign' if args.dry_run else 'signed'} the CRL again: {pki.crl_path}")
    if args.publish and not args.dry_run and pki.crl_path.exists():
        await _publish(args, pki)  # the current CRL, whether signed now or not: idempotent
    if report.ca_due:
        print(
            f"warning: the CA expires {_day(report.ca_expires)}: rotation does not renew it "
            "(docs/auth.md: what is not done yet)"
        )
    return 0


async def cmd_certs_revoke(args: argparse.Namespace) -> int:
    from cpn.rotation import held, revoke, site_of

    pki = _held_pki(args)
    names = list(args.name)
    have = {c.name for c in held(pki)} if args.site else set()
    for site in args.site:
        of_site = [n for n in (f"agent-{site}", f"credentials/{site}") if n in have]
        if not of_site:
            raise UsageError(
                f"--site {site}: no agent-{site} nor credentials/{site} in {pki.directory}"
            )
        names += [n for n in of_site if n not in names]
    if not names:
        raise UsageError("name the certificates to revoke (as `cpn certs ls` does) or --site")
    sites = {n: s for n in names if (s := site_of(pki, n)) is not None}
    if not (args.reissue and args.publish and sites):
        for old, new in revoke(pki, names, reissue=args.reissue):
            _said(old, new)
        print(f"CRL: {pki.crl_path}")
        if args.publish:
            await _publish(args, pki)
        elif sites:
            print(
                "connections to etcd the revoked credentials have open stay until they close: "
                "--reissue --publish gives each site a new etcd user and deletes the old one, "
                "which cuts them at once"
            )
        return 0
    # A site's credentials revoked and reissued, and etcd told: a new etcd user for each (the
    # new certificate's CN), the old users deleted once the new certificates are written. etcd
    # reads its CRL at a handshake only; a request's user it checks at each request, so what
    # the revoked certificates hold open is refused from then on (docs/auth.md).
    from sites.registry.admin import drop_site_users, replace_site_user

    async with registry_of(args) as registry:
        users: dict[str, str] = {}
        replaced: list[str] = []
        for name, site in sites.items():
            user, old_users = await replace_site_user(registry, site)
            users[name] = user
            replaced += old_users
        for old, new in revoke(pki, names, reissue=True, users=users):
            _said(old, new)
        await drop_site_users(registry, replaced)
        for name, user in users.items():
            print(f"  {name}: etcd user {user}")
        print(f"deleted etcd users {', '.join(replaced) or '(none)'}: their connections end now")
    print(f"CRL: {pki.crl_path}")
    await _publish(args, pki)
    return 0


def _said(old: Held, new: Held | None) -> None:
    print(f"revoked {old.name} (serial {old.serial:x})")
    if new is not None:
        print(f"  issued {new.name} anew (serial {new.serial:x}, until {_day(new.not_after)})")


async def cmd_etcd_secure(args: argparse.Namespace) -> int:
    from cpn.secure import bootstrap

    url = etcd_url(args)
    paths = await bootstrap(url, pki_of(args))
    print(f"etcd auth enabled at {url}")
    for user, path in paths.items():
        print(f"  {user}: {path}")
    return 0


def add_parsers(add: Callable[..., argparse.ArgumentParser]) -> None:
    """`cpn certs ...` and `cpn etcd secure`, added with cpn.cli's `add`."""
    certs = add("certs", help="a development CA and certificates (docs/auth.md)")
    certs_sub = certs.add_subparsers(dest="certs_command", required=True, parser_class=CliParser)
    init = certs_sub.add_parser("init", help="the CA, etcd's and the broker's certificates")
    issue = certs_sub.add_parser("issue", help="one more certificate signed by the CA")
    issue.add_argument("name", help="file name and common name (an etcd user for a client)")
    issue.add_argument("--server", action="store_true", help="a server certificate")
    for p in (init, issue):
        p.add_argument("--certs", "--dir", dest="certs", metavar="DIR", help="default: cpn up's")
        p.add_argument("--host", action="append", metavar="HOST", help="a SAN (repeatable)")
    init.set_defaults(func=cmd_certs_init)
    issue.set_defaults(func=cmd_certs_issue)
    ls = certs_sub.add_parser("ls", help="the certificates, their expiry and the CRL")
    rotate = certs_sub.add_parser(
        "rotate", help="renew the certificates that expire within --within days, in place"
    )
    rotate.add_argument("--dry-run", action="store_true", help="say what would be renewed")
    for p in (ls, rotate):
        p.add_argument(
            "--within",
            type=int,
            default=RENEW_WITHIN_DAYS,
            metavar="DAYS",
            help=f"the renewal window (default {RENEW_WITHIN_DAYS})",
        )
    ls.add_argument("-o", "--output", choices=("table", "json"), default="table")
    revoke = certs_sub.add_parser(
        "revoke", help="add certificates to the CRL: refused at their next handshake"
    )
    revoke.add_argument("name", nargs="*", help="as `cpn certs ls` names them")
    revoke.add_argument(
        "--reissue", action="store_true", help="and give each a new certificate in its place"
    )
    for p in (ls, rotate, revoke):
        p.add_argument(
            "--certs", "--dir", dest="certs", metavar="DIR", help="default: a running cpn up's"
        )
    revoke.add_argument(
        "--site",
        action="append",
        default=[],
        metavar="SITE",
        help="every certificate of the site: agent-SITE and credentials/SITE (repeatable)",
    )
    for p in (rotate, revoke):
        p.add_argument(
            "--publish",
            action="store_true",
            help="and put the CRL in etcd, where every broker and agent follows it",
        )
        etcd_arg(p)
    ls.set_defaults(func=cmd_certs_ls)
    rotate.set_defaults(func=cmd_certs_rotate)
    revoke.set_defaults(func=cmd_certs_revoke)

    etcd = add("etcd", help="etcd administration")
    etcd_sub = etcd.add_subparsers(dest="etcd_command", required=True, parser_class=CliParser)
    secure = etcd_sub.add_parser(
        "secure", help="enable auth on an etcd with TLS; write root's and the broker's credentials"
    )
    secure.add_argument("--etcd", metavar="URL[,URL...]", help="https:// endpoints")
    secure.add_argument("--certs", metavar="DIR", help="the CA etcd trusts (cpn certs init)")
    secure.set_defaults(func=cmd_etcd_secure)
