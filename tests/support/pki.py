"""A throwaway certificate authority per test (trustme), laid out the way deploy/nats/*.conf
expect it under /etc/nats/tls: ``ca.pem``, ``server.pem``/``server-key.pem`` (valid for
127.0.0.1 and localhost), ``<name>.pem``/``<name>-key.pem`` for each client, and the
cluster routes' own CA ``route-ca.pem`` with ``route.pem``/``route-key.pem``."""

from __future__ import annotations

import ssl
from pathlib import Path

import trustme

TLS_DIR = "/etc/nats/tls"
"""Where the deploy configs read their certificates; tests replace it with :attr:`Pki.dir`."""


class Pki:
    def __init__(
        self, directory: Path, hosts: tuple[str, ...] = ("127.0.0.1", "localhost")
    ) -> None:
        """Certificates for servers and routes valid for ``hosts`` (names or addresses)."""
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ca = trustme.CA()
        self.ca.cert_pem.write_to_path(str(self.ca_file))
        self.issue("server", *hosts)
        self.route_ca = trustme.CA()
        self.route_ca.cert_pem.write_to_path(str(self.dir / "route-ca.pem"))
        route = self.route_ca.issue_cert(*hosts)
        route.cert_chain_pems[0].write_to_path(str(self.dir / "route.pem"))
        route.private_key_pem.write_to_path(str(self.dir / "route-key.pem"))

    @property
    def ca_file(self) -> Path:
        return self.dir / "ca.pem"

    def issue(self, name: str, *identities: str) -> tuple[Path, Path]:
        """``<name>.pem`` and ``<name>-key.pem``, for ``identities`` (subjectAltNames: DNS
        names, IP addresses or email addresses) or ``name`` when none are given."""
        cert = self.ca.issue_cert(*(identities or (name,)))
        cert_file, key_file = self.dir / f"{name}.pem", self.dir / f"{name}-key.pem"
        cert.cert_chain_pems[0].write_to_path(str(cert_file))
        cert.private_key_pem.write_to_path(str(key_file))
        return cert_file, key_file

    def client(self, name: str = "", *identities: str) -> ssl.SSLContext:
        """A client context trusting the CA, presenting the certificate ``name`` (issued
        now for ``identities``) unless ``name`` is empty."""
        context = ssl.create_default_context(cafile=str(self.ca_file))
        if name:
            cert_file, key_file = self.issue(name, *identities)
            context.load_cert_chain(str(cert_file), str(key_file))
        return context
