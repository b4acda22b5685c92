"""tools/deploy/base_image.py's mmdebstrap command: the packages the recipes need, and a host's CAs made
trusted by the system and by pip (the hooks run here on a folder standing in for the root file system)."""

from __future__ import annotations

import subprocess

from tool_modules import import_tools

(base_image,) = import_tools("deploy.base_image")


def hooks(command: list[str]) -> list[str]:
    return [arg.removeprefix("--customize-hook=") for arg in command if arg.startswith("--customize-hook=")]


def test_the_base_has_what_the_recipe_and_its_health_check_run():
    command = base_image.mmdebstrap_command("bookworm", "http://deb.debian.org/debian", [*base_image.PACKAGES], [])
    included = command[command.index("--variant=minbase") + 1].removeprefix("--include=").split(",")
    # python (HEALTHCHECK, `python -m venv`), venv's ensurepip, groupadd/useradd, TLS roots for pip
    assert {"python-is-python3", "python3-venv", "passwd", "ca-certificates"} <= set(included)
    assert command[-3:] == ["bookworm", "-", "http://deb.debian.org/debian"]  # the tar goes to stdout


def test_host_cas_are_copied_in_and_named_in_pip_conf(tmp_path):
    ca = tmp_path / "proxy.crt"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    command = base_image.mmdebstrap_command("bookworm", "http://deb.debian.org/debian", ["python3"], [ca])
    copy_in, update, pip_conf, cleanup = hooks(command)
    assert copy_in == f"copy-in {ca} /usr/local/share/ca-certificates/"
    assert update == 'chroot "$1" update-ca-certificates'
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    subprocess.run(["sh", "-c", pip_conf, "sh", str(root)], check=True)
    assert (root / "etc/pip.conf").read_text() == "[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n"
    assert "apt/lists" in cleanup


def test_without_cas_pip_keeps_its_own_bundle():
    command = base_image.mmdebstrap_command("bookworm", "http://deb.debian.org/debian", ["python3"], [])
    assert not any("pip.conf" in hook or "copy-in" in hook for hook in hooks(command))
