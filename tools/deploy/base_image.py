#!/usr/bin/env python3
"""A Debian base image made here, for hosts that reach Debian's mirror but no container registry.

docker/Dockerfile.cpu starts from ``python:3.12-slim-bookworm`` (Docker Hub). Where no registry can be
reached, this makes a stand-in from Debian's own packages: ``mmdebstrap`` (Debian package) builds a
minimal bookworm root file system with Python 3.11 (``python3``, ``python3-venv``, ``python-is-python3``
for the ``python`` the recipe and its health check call, ``passwd`` for ``groupadd``/``useradd``), and
``podman import`` (or ``buildah``'s) turns it into an image. Then the recipe builds on it unchanged:

    python tools/deploy/base_image.py                                  # localhost/edgedecode-base:bookworm
    podman build --build-arg PYTHON_IMAGE=localhost/edgedecode-base:bookworm \\
        -f docker/Dockerfile.cpu -t edgedecode:cpu .

``--systemd`` adds ``systemd``, ``systemd-sysv`` (``/sbin/init``) and ``libnss-systemd`` (names of
``DynamicUser=`` users), for booting the units of systemd/ in a container (tests/test_deploy_systemd.py):

    python tools/deploy/base_image.py --systemd --tag localhost/edgedecode-systemd-base:bookworm

A host behind a TLS-inspecting proxy needs its CA inside the image for pip to reach PyPI: every
``--ca FILE`` (default: the host's ``/usr/local/share/ca-certificates/*.crt``) is installed with
``update-ca-certificates`` and named in ``/etc/pip.conf`` (``cert =``). Needs root (mmdebstrap's root mode).
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import tools.* (and edgedecode) from the repo root, as `python -m` would
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import logging
import shlex
import shutil
import subprocess

from tools.common import cli

log = logging.getLogger(__name__)

PACKAGES = ("python3", "python3-venv", "python-is-python3", "passwd", "ca-certificates")
SYSTEMD_PACKAGES = ("systemd", "systemd-sysv", "libnss-systemd")
LOCAL_CAS = Path("/usr/local/share/ca-certificates")


def mmdebstrap_command(suite: str, mirror: str, packages: list[str], cas: list[Path]) -> list[str]:
    """mmdebstrap writing a minbase root file system with ``packages`` (and ``cas`` trusted) as a tar to stdout."""
    hooks = []
    if cas:
        copy_in = " ".join(shlex.quote(str(ca)) for ca in cas)
        hooks += [
            f"copy-in {copy_in} /usr/local/share/ca-certificates/",
            'chroot "$1" update-ca-certificates',
            "printf '[global]\\ncert = /etc/ssl/certs/ca-certificates.crt\\n' > \"$1/etc/pip.conf\"",
        ]
    hooks.append('rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*')
    return [
        "mmdebstrap",
        "--variant=minbase",
        f"--include={','.join(packages)}",
        *(f"--customize-hook={hook}" for hook in hooks),
        suite,
        "-",
        mirror,
    ]


def import_command(tag: str) -> list[str]:
    """podman's command that makes image ``tag`` of a root file system tar read from stdin (buildah, which
    has no import, sees it too: both keep images in containers/storage)."""
    return ["podman", "import", "--change", 'CMD ["python3"]', "-", tag]


def main(argv: list[str] | None = None) -> int | None:
    p = cli.parser(__doc__)
    p.add_argument("--tag", default="localhost/edgedecode-base:bookworm", help="the image's name")
    p.add_argument("--suite", default="bookworm", help="Debian suite (bookworm has Python 3.11)")
    p.add_argument("--mirror", default="http://deb.debian.org/debian")
    p.add_argument("--systemd", action="store_true", help="add systemd as /sbin/init (for the unit tests)")
    p.add_argument("--ca", type=Path, action="append", help="a CA certificate to trust (repeat; default: the host's)")
    args = p.parse_args(argv)
    for tool in ("mmdebstrap", "podman"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} not found: apt-get install mmdebstrap podman")
    cas = args.ca if args.ca is not None else sorted(LOCAL_CAS.glob("*.crt"))
    packages = [*PACKAGES, *(SYSTEMD_PACKAGES if args.systemd else ())]
    bootstrap = mmdebstrap_command(args.suite, args.mirror, packages, cas)
    log.info("%s | %s", shlex.join(bootstrap), shlex.join(import_command(args.tag)))
    with subprocess.Popen(bootstrap, stdout=subprocess.PIPE) as rootfs:
        imported = subprocess.run(import_command(args.tag), stdin=rootfs.stdout, check=False)
    if rootfs.returncode or imported.returncode:
        log.error("mmdebstrap exited %s, import exited %s", rootfs.returncode, imported.returncode)
        return 1
    log.info("made %s", args.tag)
    return None


if __name__ == "__main__":
    cli.run(main)
