"""`cpn certs init|issue`, `cpn etcd secure`: a development CA with its certificates
(cpn.certs), and auth turned on in an etcd that serves TLS (cpn.secure); docs/auth.md.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from cpn.certs import DEFAULT_HOSTS
from cpn.cli_base import CliParser, etcd_url, pki_of

__all__ = ["add_parsers", "cmd_certs_init", "cmd_certs_issue", "cmd_etcd_secure"]


def cmd_certs_init(args: argparse.Namespace) -> int:
    from cpn.secure import init_pki

    pki = pki_of(args)
    created = pki.init()
    tls = init_pki(pki, args.host)
    print(f"{'created' if created else 'kept'} the CA {pki.ca_path}")
    print(f"etcd: --cert-file {tls.cert_file} --key-file {tls.key_file} ", end="")
    print(f"--trusted-ca-file {tls.ca_file} --client-cert-auth")
    print(f"broker: --tls-cert {pki.directory / 'broker.pem'} --tls-key ", end="")
    print(f"{pki.directory / 'broker-key.pem'}")
    return 0


def cmd_certs_issue(args: argparse.Namespace) -> int:
    pki = pki_of(args)
    issued = pki.issue(args.name, hosts=args.host or DEFAULT_HOSTS, server=args.server)
    print(f"{issued.cert_path} {issued.key_path}")
    return 0


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

    etcd = add("etcd", help="etcd administration")
    etcd_sub = etcd.add_subparsers(dest="etcd_command", required=True, parser_class=CliParser)
    secure = etcd_sub.add_parser(
        "secure", help="enable auth on an etcd with TLS; write root's and the broker's credentials"
    )
    secure.add_argument("--etcd", metavar="URL[,URL...]", help="https:// endpoints")
    secure.add_argument("--certs", metavar="DIR", help="the CA etcd trusts (cpn certs init)")
    secure.set_defaults(func=cmd_etcd_secure)
