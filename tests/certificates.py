"""Certificates for TLS tests, made with ``cryptography``: an authority and
certificates it signs (docs/security.md shows the same with ``openssl``)."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Optional

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _name(common: str, organization: Optional[str]) -> x509.Name:
    parts = [x509.NameAttribute(NameOID.COMMON_NAME, common)]
    if organization is not None:
        parts.insert(0, x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(parts)


class Authority:
    """A certificate authority writing PEM files into *directory*."""

    def __init__(self, directory: Path, name: str = "Test CA") -> None:
        self.directory = directory
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.name = _name(name, None)
        now = datetime.datetime.now(datetime.timezone.utc)
        self.certificate = (
            x509.CertificateBuilder().subject_name(self.name).issuer_name(self.name)
            .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256()))
        self.pem = self.write("ca.pem" if name == "Test CA" else f"{name}.pem",
                              self.certificate.public_bytes(serialization.Encoding.PEM))

    def write(self, name: str, data: bytes) -> Path:
        path = self.directory / name
        path.write_bytes(data)
        return path

    def issue(self, file: str, common: str, organization: Optional[str] = None) -> tuple[Path, Path]:
        """A certificate for *common* (and *organization*): (cert.pem, key.pem)."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        certificate = (
            x509.CertificateBuilder().subject_name(_name(common, organization))
            .issuer_name(self.name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .sign(self.key, hashes.SHA256()))
        cert = self.write(f"{file}.pem", certificate.public_bytes(serialization.Encoding.PEM))
        private = self.write(f"{file}.key", key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption()))
        return cert, private
