"""A small certificate authority for one fleet: a CA, a server certificate per broker, a client certificate per node.

The broker (``deploy/mosquitto/mosquitto-mtls.conf``) requires a client certificate signed by this
CA and takes the certificate's common name as the MQTT username (``use_identity_as_username``),
so the shipped ACL binds a device to its own topics by its certificate: a device holding
hive-0001's key can publish only as hive-0001. Issued with a site, a device is bound to that
site as well: :func:`write_acl` turns the CA folder's register of issued certificates
(``issued.jsonl``) into a Mosquitto ACL with one entry per node, so hive-0001 of site s1 cannot
publish as ``other-site/hive-0001`` either. Keys are ECDSA P-256 (small and fast on a
microcontroller-class device); private keys are written 0600 and never leave the folder they were
made in. Built on ``cryptography``.
"""
from __future__ import annotations

import datetime as dt
import ipaddress
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_CERT = "ca.crt"
CA_KEY = "ca.key"
REGISTER = "issued.jsonl"  # one line per client certificate issued: name, role, site
ROLES = ("device", "cloud", "bridge")
NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # a node name (topics allow no more) or a host name


class PkiError(ValueError):
    """A CA folder, name or host that cannot be used; the message says which and why."""


@dataclass(frozen=True, slots=True)
class Issued:
    cert: Path
    key: Path


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _subject(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def init_ca(folder: str | Path, *, name: str = "apiary-fleet-ca", days: int = 3650) -> Issued:
    """A new CA in ``folder`` (refused if one is there: re-issuing every device is not an accident)."""
    folder = Path(folder)
    cert_path, key_path = folder / CA_CERT, folder / CA_KEY
    if cert_path.exists() or key_path.exists():
        raise PkiError(f"{folder} already holds a CA ({CA_CERT}/{CA_KEY}); move it away to make a new one")
    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_subject(name)).issuer_name(_subject(name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    _write_key(key_path, key)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return Issued(cert_path, key_path)


def _load_ca(folder: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    try:
        cert = x509.load_pem_x509_certificate((folder / CA_CERT).read_bytes())
        key = serialization.load_pem_private_key((folder / CA_KEY).read_bytes(), password=None)
    except FileNotFoundError:
        raise PkiError(f"no CA in {folder}: run `apiary pki init --dir {folder}` first") from None
    except ValueError as e:
        raise PkiError(f"the CA in {folder} cannot be read: {e}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise PkiError(f"the CA key in {folder} is not an EC key")
    return cert, key


def issue(folder: str | Path, name: str, *, server: bool = False, hosts: list[str] | None = None,
          days: int = 825, out: str | Path | None = None, role: str = "device", site: str | None = None) -> Issued:
    """A certificate signed by the CA in ``folder`` with common name ``name``: a client certificate (the node's
    MQTT identity, recorded in the CA's register with its ``role`` and, for a device, its ``site``) or, with
    ``server``, a broker/API certificate for ``hosts`` (IP addresses or DNS names).
    Written as ``<name>.crt``/``<name>.key`` in ``out`` (default: the CA folder)."""
    folder = Path(folder)
    if not NAME.match(name):
        raise PkiError(f"name {name!r} must be 1-64 of A-Z a-z 0-9 _ . - (a node name or a host name)")
    if role not in ROLES:
        raise PkiError(f"role {role!r} is not one of {', '.join(ROLES)}")
    if site is not None and (server or role != "device" or not NAME.match(site) or site.startswith("_")):
        raise PkiError(f"a site ({site!r}) binds a device certificate; it must be a site name (A-Z a-z 0-9 _ . -)")
    ca_cert, ca_key = _load_ca(folder)
    sans: list[x509.GeneralName] = []
    for host in hosts or ([name] if server else []):
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            if not NAME.match(host):
                raise PkiError(f"host {host!r} is neither an IP address nor a DNS name") from None
            sans.append(x509.DNSName(host))
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (x509.CertificateBuilder().subject_name(_subject(name)).issuer_name(ca_cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    target = Path(out) if out is not None else folder
    target.mkdir(parents=True, exist_ok=True)
    issued = Issued(target / f"{name}.crt", target / f"{name}.key")
    _write_key(issued.key, key)
    issued.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if not server:
        with open(folder / REGISTER, "a") as f:
            f.write(json.dumps({"name": name, "role": role, "site": site, "serial": cert.serial_number}) + "\n")
    return issued


def write_acl(folder: str | Path, path: str | Path) -> Path:
    """A Mosquitto ACL for every client certificate the CA issued (its latest role and site per name).

    ``cloud``: the whole mesh. ``bridge``: events of every device, answers, its own node. A device: only its
    own node, and only under its site when it was issued with one (``+`` otherwise). No pattern lines, so a
    name the CA never issued gets nothing.
    """
    folder = Path(folder)
    nodes: dict[str, dict] = {}
    try:
        for line in (folder / REGISTER).read_text().splitlines():
            if line.strip():
                entry = json.loads(line)
                nodes[entry["name"]] = entry
    except FileNotFoundError:
        raise PkiError(f"{folder} has issued no client certificates yet (apiary pki issue NAME)") from None
    except (ValueError, KeyError) as e:
        raise PkiError(f"{folder / REGISTER} is damaged: {e}") from None
    lines = ["# Apiary Mesh ACL written by `apiary pki acl` from the fleet CA's register; regenerate, do not edit.",
             "# The broker takes each client certificate's common name as the user (use_identity_as_username)."]
    for name, entry in sorted(nodes.items()):
        lines.append(f"\nuser {name}")
        if entry["role"] == "cloud":
            lines.append("topic readwrite apiary/#")
        elif entry["role"] == "bridge":
            lines += ["topic write apiary/v1/+/+/event", "topic read apiary/v1/+/+/answer",
                      f"topic readwrite apiary/v1/+/{name}/#"]
        else:
            lines.append(f"topic readwrite apiary/v1/{entry.get('site') or '+'}/{name}/#")
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("\n".join(lines) + "\n")
    return target
