"""TLS contexts from PEM files: what a server serves HTTPS with, and what a client verifies servers
with. Only the standard library's ``ssl``, so every layer may use it (the configuration checks the
files with it at start; the servers, the daemon's prefill client and ``edgedecode chat`` use it)."""

from __future__ import annotations

import ssl


def server_tls(cert_file: str, key_file: str) -> ssl.SSLContext | None:
    """The TLS context of a server with this PEM certificate (chain) and private key; None (plain
    HTTP) when no certificate is given.

    Raises:
        OSError: a file cannot be read.
        ssl.SSLError: they are not a PEM certificate and its key.
    """
    if not cert_file:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)  # TLS 1.2 or newer, Python's default ciphers
    context.load_cert_chain(cert_file, key_file)
    return context


def client_tls(ca_file: str = "") -> ssl.SSLContext:
    """The TLS context of a client that verifies servers (certificate chain and host name) against the
    PEM CA certificates of ``ca_file``, or the system's when it is empty. Verification is never off.

    Raises:
        OSError: ``ca_file`` cannot be read.
        ssl.SSLError: it holds no PEM certificate.
    """
    return ssl.create_default_context(cafile=ca_file or None)
