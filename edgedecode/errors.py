"""The root of edgedecode's error hierarchy.

Each layer defines its own small error classes next to the code that raises them; they all derive
from :class:`EdgeDecodeError`, so surfaces (the CLI, the daemons) can turn any of them into a clear
message without catching unrelated bugs. Each class also says how a server answers it when it
escapes a request handler (``serving/http.py`` maps every one the same way, in OpenAI's error shape):
an unexpected failure (500) unless the class says otherwise.
"""


class EdgeDecodeError(Exception):
    """A failure with a message meant for the operator: what went wrong and, where known, what to do."""

    http_status = 500
    http_type = "server_error"  # OpenAI's error "type"
    http_code: str | None = None  # OpenAI's error "code"
    param: str | None = None  # the request field at fault
    retry_after_s: int | None = None  # a Retry-After header: the client may try again then


class RequestError(EdgeDecodeError):
    """A request a server cannot take as given; ``param`` names the offending field (answered with 400)."""

    http_status = 400
    http_type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ServerBusyError(EdgeDecodeError):
    """Too many requests are waiting; the client should retry shortly (429)."""

    http_status = 429
    http_type = "rate_limit_error"
    http_code = "queue_full"
    retry_after_s = 1
