"""The containers' health check: GET /readyz of the decode daemon in this container; exit 0 on 200.

It reads the daemon's settings as `edgedecode serve` does (/etc/edgedecode/edgedecode.toml when
present, then the EDGEDECODE_DAEMON_* variables), so the port, the bearer token and TLS match. /readyz
answers 503 while the decode worker is unhealthy, and nothing answers until the model is loaded.
"""

from __future__ import annotations

import ssl
import sys
import urllib.error
import urllib.request

from edgedecode.config import load_config
from edgedecode.errors import EdgeDecodeError

TIMEOUT_S = 4.0


def readyz_request() -> tuple[urllib.request.Request, ssl.SSLContext | None]:
    daemon = load_config(server="daemon").daemon
    host = "127.0.0.1" if daemon.host in ("0.0.0.0", "", "localhost") else daemon.host
    host = "[::1]" if host == "::" else f"[{host}]" if ":" in host else host
    context = None
    if daemon.tls_cert_file:
        context = ssl.create_default_context()
        context.check_hostname = False  # this container's own daemon, over loopback
        context.verify_mode = ssl.CERT_NONE
    request = urllib.request.Request(f"{'https' if context else 'http'}://{host}:{daemon.port}/readyz")
    if daemon.auth_token:
        request.add_header("Authorization", f"Bearer {daemon.auth_token}")
    return request, context


def main() -> int:
    try:
        request, context = readyz_request()
        with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=context) as response:
            status = response.status
    except urllib.error.HTTPError as exc:
        status = exc.code
    except (EdgeDecodeError, OSError) as exc:
        print(f"unhealthy: {exc}")
        return 1
    print("ready" if status == 200 else f"unhealthy: /readyz answered {status}")
    return 0 if status == 200 else 1


if __name__ == "__main__":
    sys.exit(main())
