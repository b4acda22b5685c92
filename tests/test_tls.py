"""TLS end to end, with a CA made by the test (conftest's ``tls_files``): a prefill server and a decode
daemon serving HTTPS only, the daemon pulling KV over https and verifying the prefill server with that
CA, and ``edgedecode chat`` verifying the daemon with it. Plain HTTP to either port and clients without
the CA are refused. The prefill server also accepts the token being rotated out
(``previous_auth_token``), which the daemon still sends. Then the configuration's TLS checks (no model).
"""

from __future__ import annotations

import io
import json
import os
import ssl
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
import trustme
from serving_helpers import ServerProcess, server_config

from edgedecode.client.chat import ChatClient, ChatError
from edgedecode.config import ConfigError, load_config
from edgedecode.tls import client_tls

TOKEN = "daemon-secret"
NEW_TOKEN, OLD_TOKEN = "prefill-new", "prefill-old"  # the prefill server's token, mid-rotation
QUESTION = "What is the capital of France? Answer in one sentence."


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("tls")


@pytest.fixture(scope="module")
def prefill_server(smollm2_model, tls_files, workdir):
    """HTTPS and both tokens from the environment (as systemd's env file gives them)."""
    server = ServerProcess(
        ["prefill-server", "--config", server_config(workdir, "prefill", prefill_token="", budget=0.3)],
        workdir / "prefill.log",
        env={
            "EDGEDECODE_PREFILL_AUTH_TOKEN": NEW_TOKEN,
            "EDGEDECODE_PREFILL_PREVIOUS_AUTH_TOKEN": OLD_TOKEN,
            "EDGEDECODE_PREFILL_TLS_CERT_FILE": str(tls_files.cert),
            "EDGEDECODE_PREFILL_TLS_KEY_FILE": str(tls_files.key),
        },
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def daemon(prefill_server, tls_files, workdir):
    """HTTPS from the TOML file; it pulls from the https prefill server, verified with the test CA."""
    config = server_config(
        workdir,
        "daemon",
        prefill_token=OLD_TOKEN,  # not moved to the new token yet
        budget=0.3,
        tls_cert_file=str(tls_files.cert),
        tls_key_file=str(tls_files.key),
        prefill_ca_file=str(tls_files.ca),
    )
    server = ServerProcess(
        ["serve", "--config", config, "--prefill-url", prefill_server.url],
        workdir / "daemon.log",
        env={"EDGEDECODE_DAEMON_AUTH_TOKEN": TOKEN},
    )
    yield server
    server.stop()


def _status(url: str, token: str | None, tls: ssl.SSLContext) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30, context=tls) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_a_chat_over_https_gets_kv_pulled_over_https(daemon, prefill_server, tls_files):
    assert daemon.url.startswith("https://127.0.0.1:") and prefill_server.url.startswith("https://127.0.0.1:")
    client = ChatClient(daemon.url, TOKEN, max_tokens=8, ca_file=tls_files.ca)
    report = client.send(QUESTION, io.StringIO()).report
    assert report["kv"]["source"] == "prefill_server", report
    assert report["kv"]["fallback_reason"] is None and report["kv"]["pulled_tokens"] > 0

    chat = subprocess.run(
        [sys.executable, "-m", "edgedecode", "chat", "--url", daemon.url, "--ca-file", str(tls_files.ca), "-n", "8"],
        input=QUESTION + "\n",
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "EDGEDECODE_DAEMON_AUTH_TOKEN": TOKEN},
    )
    assert chat.returncode == 0, chat.stderr
    assert "Paris" in chat.stdout and "KV pulled" in chat.stderr


def test_plain_http_to_the_tls_ports_gets_no_answer(daemon, prefill_server):
    for server in (daemon, prefill_server):
        plain = server.url.replace("https://", "http://", 1) + "/healthz"
        with pytest.raises(ConnectionError):  # the server reads no TLS ClientHello and hangs up
            urllib.request.urlopen(plain, timeout=30)


def test_a_client_without_the_ca_cannot_verify_either_server(daemon, prefill_server):
    for server in (daemon, prefill_server):
        with pytest.raises(urllib.error.URLError) as refused:
            urllib.request.urlopen(server.url + "/healthz", timeout=30, context=client_tls())
        assert isinstance(refused.value.reason, ssl.SSLCertVerificationError)
    with pytest.raises(ChatError, match="CERTIFICATE_VERIFY_FAILED"):
        ChatClient(daemon.url, TOKEN, max_tokens=8).send(QUESTION, io.StringIO())


def test_the_prefill_server_takes_its_new_and_previous_tokens_and_no_other(prefill_server, tls_files):
    tls = client_tls(str(tls_files.ca))
    models = prefill_server.url + "/v1/models"
    statuses = {token: _status(models, token, tls) for token in (NEW_TOKEN, OLD_TOKEN, "prefill-older", None)}
    assert statuses == {NEW_TOKEN: 200, OLD_TOKEN: 200, "prefill-older": 401, None: 401}


def test_a_daemon_that_cannot_verify_the_prefill_server_pulls_nothing_from_it(prefill_server, workdir):
    stranger = workdir / "another-ca.pem"  # a CA that did not sign the prefill server's certificate
    trustme.CA().cert_pem.write_to_path(stranger)
    config = server_config(workdir, "untrusting", prefill_token=NEW_TOKEN, budget=0.3, prefill_ca_file=str(stranger))
    daemon = ServerProcess(
        ["serve", "--config", config, "--prefill-url", prefill_server.url], workdir / "untrusting.log"
    )
    try:
        report = ChatClient(daemon.url, max_tokens=4).send(QUESTION, io.StringIO()).report
    finally:
        daemon.stop()
    assert (report["kv"]["source"], report["kv"]["fallback_reason"]) == ("local", "unreachable")
    assert "CERTIFICATE_VERIFY_FAILED" in daemon.log.read_text()


# --- the configuration's TLS checks ---------------------------------------------------------------


def _load(tmp_path, daemon: dict[str, str] | None = None, prefill: dict[str, str] | None = None):
    lines = ["[daemon]", *(f"{k} = {json.dumps(v)}" for k, v in (daemon or {}).items())]
    lines += ["[prefill]", *(f"{k} = {json.dumps(v)}" for k, v in (prefill or {}).items())]
    path = tmp_path / "edgedecode.toml"
    path.write_text("\n".join(lines) + "\n")
    return load_config(path, env={})


def test_a_certificate_and_its_key_load_and_serve_tls(tmp_path, tls_files):
    config = _load(
        tmp_path,
        {"prefill_url": "https://127.0.0.1:8089", "prefill_ca_file": str(tls_files.ca)},
        {"tls_cert_file": str(tls_files.cert), "tls_key_file": str(tls_files.key)},
    )
    assert (config.prefill.tls_cert_file, config.daemon.prefill_ca_file) == (str(tls_files.cert), str(tls_files.ca))


@pytest.mark.parametrize(
    "section, settings, message",
    [
        ("daemon", {"tls_cert_file": "{cert}"}, "daemon.tls_cert_file and daemon.tls_key_file go together"),
        ("prefill", {"tls_key_file": "{key}"}, "prefill.tls_cert_file and prefill.tls_key_file go together"),
        (
            "prefill",
            {"tls_cert_file": "{tmp}/missing.pem", "tls_key_file": "{key}"},
            "prefill.tls_cert_file: cannot read {tmp}/missing.pem: No such file or directory",
        ),
        (
            "daemon",
            {"tls_cert_file": "{cert}", "tls_key_file": "{other_key}"},
            "daemon.tls_cert_file ({cert}) and daemon.tls_key_file ({other_key}) are not a PEM certificate and its",
        ),
        (
            "daemon",
            {"tls_cert_file": "{ca}", "tls_key_file": "{ca}"},
            "are not a PEM certificate and its private key",
        ),
        (
            "daemon",
            {"prefill_url": "http://10.0.0.5:8089", "prefill_ca_file": "{ca}"},
            "daemon.prefill_ca_file is set, but daemon.prefill_url ('http://10.0.0.5:8089') is not an https URL",
        ),
        (
            "daemon",
            {"prefill_url": "https://10.0.0.5:8089", "prefill_ca_file": "{key}"},
            "daemon.prefill_ca_file ({key}) holds no PEM CA certificate",
        ),
        ("prefill", {"previous_auth_token": "old"}, "prefill.previous_auth_token needs prefill.auth_token"),
    ],
)
def test_tls_settings_that_cannot_work_are_refused_naming_the_key(tmp_path, tls_files, section, settings, message):
    other_key = tmp_path / "other-key.pem"
    trustme.CA().issue_cert("127.0.0.1").private_key_pem.write_to_path(other_key)
    names = {"cert": tls_files.cert, "key": tls_files.key, "ca": tls_files.ca, "other_key": other_key, "tmp": tmp_path}
    values = {key: value.format(**names) for key, value in settings.items()}
    with pytest.raises(ConfigError) as refused:
        _load(tmp_path, **{section: values})
    assert message.format(**names) in str(refused.value)


def test_an_https_prefill_url_without_any_ca_to_verify_it_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "none.pem"))  # the system's CA store, made absent
    monkeypatch.setenv("SSL_CERT_DIR", str(tmp_path / "none"))
    with pytest.raises(ConfigError, match=r"no CA certificates to verify it with: set daemon\.prefill_ca_file"):
        _load(tmp_path, {"prefill_url": "https://prefill.example:8089"})
    assert _load(tmp_path, {"prefill_url": "http://prefill.example:8089"}).daemon.prefill_ca_file == ""


def test_only_the_running_servers_tls_files_are_read(tmp_path, tls_files):
    other_units_key = str(tmp_path / "readable-by-the-prefill-unit-only.pem")  # one file, two units, one host
    path = tmp_path / "shared.toml"
    path.write_text(f'[prefill]\ntls_cert_file = "{tls_files.cert}"\ntls_key_file = "{other_units_key}"\n')
    assert load_config(path, env={}, server="daemon").prefill.tls_key_file == other_units_key
    with pytest.raises(ConfigError, match=r"prefill\.tls_key_file: cannot read"):
        load_config(path, env={}, server="prefill")
