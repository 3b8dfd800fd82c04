"""HTTPS for the simulator: a throw-away CA and a server certificate made at test time.

The proxy opens its own TLS connections to an upstream (``addons/gateway/transport/relay.py``'s pool, provider
feedback's second attempt), so what it verifies must be tested against a real handshake: a
plain-HTTP simulator lets a relay that ignores ``ssl_verify_upstream_trusted_ca`` or
``ssl_insecure`` pass every test. Nothing here is a file in the repository: the keys are
generated (``cryptography``, which mitmproxy depends on) and written to a temporary folder only
because ``ssl`` and mitmproxy's options take paths.

    ca = TestCA()
    with ProviderSimulator(tls=ca.server("localhost")) as sim:   # https://localhost:<port>
        ...  # trust ca.path
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())  # fast to make, accepted by every client


def _pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


@dataclass
class ServerCert:
    """A certificate and key for the simulator, and the folder they live in."""

    cert: Path
    key: Path
    hostnames: tuple[str, ...]

    def context(self) -> ssl.SSLContext:
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.load_cert_chain(self.cert, self.key)
        tls.set_alpn_protocols(["http/1.1"])
        return tls


class TestCA:
    """A root CA; ``path`` is its certificate (what a client trusts)."""

    __test__ = False  # not a pytest class

    def __init__(self, name: str = "llm-interceptor test CA") -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="sim-tls-")
        self.folder = Path(self._dir.name)
        self.key = _key()
        now = datetime.datetime.now(datetime.timezone.utc)
        self.cert = (
            x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
            .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self.key.public_key()), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        self.path = self.folder / "ca.pem"
        self.path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def server(self, *hostnames: str) -> ServerCert:
        """A leaf certificate for these DNS names or IP addresses, signed by this CA."""
        names = hostnames or ("localhost",)
        alt: list[x509.GeneralName] = []
        for h in names:
            try:
                alt.append(x509.IPAddress(ipaddress.ip_address(h)))
            except ValueError:
                alt.append(x509.DNSName(h))
        key = _key()
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (
            x509.CertificateBuilder().subject_name(_name(names[0])).issuer_name(self.cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.SubjectAlternativeName(alt), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        stem = "-".join(names).replace(":", "_")
        cert_path, key_path = self.folder / f"{stem}.pem", self.folder / f"{stem}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(_pem(key))
        return ServerCert(cert_path, key_path, names)

    def cleanup(self) -> None:
        self._dir.cleanup()

    def __enter__(self) -> TestCA:
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()
