"""Test certificates made with the ``openssl`` command: a CA, a service certificate for
127.0.0.1 / localhost (used by the target, the draft and the router, as server and as client)
and a client certificate, each an EC P-256 key valid for two days."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

SERVICE_SAN = "IP:127.0.0.1,DNS:localhost"


@dataclass(frozen=True)
class Certs:
    ca: Path  # the CA certificate that signs every leaf below
    service_cert: Path  # serverAuth + clientAuth, SAN 127.0.0.1 / localhost
    service_key: Path
    client_cert: Path  # clientAuth only
    client_key: Path


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_ca(directory: Path, name: str = "ca") -> tuple[Path, Path]:
    """A self-signed CA: (certificate, key) at ``directory/name.pem`` / ``name.key``."""
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", f"/CN=specmesh test {name}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )  # fmt: skip
    return cert, key


def issue(
    directory: Path, name: str, ca: tuple[Path, Path], usage: str, san: str = ""
) -> tuple[Path, Path]:
    """A leaf certificate signed by ``ca``: (certificate, key). ``usage`` is the
    extendedKeyUsage (``serverAuth,clientAuth`` or ``clientAuth``)."""
    cert, key, csr = (directory / f"{name}{ext}" for ext in (".pem", ".key", ".csr"))
    ext = directory / f"{name}.ext"
    lines = ["basicConstraints=CA:FALSE", f"extendedKeyUsage={usage}"]
    ext.write_text("\n".join([*lines, f"subjectAltName={san}"] if san else lines) + "\n")
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", str(key), "-out", str(csr), "-subj", f"/CN=specmesh {name}",
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]),
        "-CAcreateserial", "-out", str(cert), "-days", "2", "-extfile", str(ext),
    )  # fmt: skip
    return cert, key


def make_certs(directory: Path) -> Certs:
    """Everything a TLS cluster on loopback needs, written under ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    ca = make_ca(directory)
    service = issue(directory, "service", ca, "serverAuth,clientAuth", SERVICE_SAN)
    client = issue(directory, "client", ca, "clientAuth")
    return Certs(ca[0], *service, *client)
