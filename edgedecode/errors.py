"""The root of edgedecode's error hierarchy.

Each layer defines its own small error classes next to the code that raises them; they all derive
from :class:`EdgeDecodeError`, so surfaces (the CLI, the daemons) can turn any of them into a clear
message without catching unrelated bugs.
"""


class EdgeDecodeError(Exception):
    """A failure with a message meant for the operator: what went wrong and, where known, what to do."""


class RequestError(EdgeDecodeError):
    """A request a server cannot take as given; ``param`` names the offending field (answered with 400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
