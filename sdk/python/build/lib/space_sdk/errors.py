"""Errors: every API error is a :class:`SpaceError` with the HTTP status and space's stable code."""

from typing import Any, Optional


class SpaceError(Exception):
    """An error answered by spaced (`{"error": {"code", "message"}}`), or a broken stream."""

    def __init__(self, status: Optional[int], code: str, message: str):
        super().__init__(f"{message} ({code})" if code else message)
        self.status = status
        self.code = code
        self.message = message


class InvalidArgument(SpaceError):
    """400: the request is wrong (the message names what)."""


class Unauthorized(SpaceError):
    """401 or 403: no key, a wrong one, or a revoked one."""


class NotFound(SpaceError):
    """404: no such sandbox, snapshot, process, file, template, secret or pool."""


class Conflict(SpaceError):
    """409: the call does not fit the object's state (a paused sandbox, a taken name...)."""


class PreconditionFailed(SpaceError):
    """412: e.g. reading a directory as a file, writing to a process without open stdin."""


class TooLarge(SpaceError):
    """413: past a size limit."""


class ExecError(SpaceError):
    """A command ended with a non-zero exit code or a signal (`check=True`)."""

    def __init__(self, result: Any):
        what = (
            f"exit code {result.exit_code}"
            if result.exit_code is not None
            else f"signal {result.signal}"
        )
        super().__init__(None, "exec_failed", f"command failed with {what}: {result.stderr[-500:]!r}")
        self.result = result


_BY_STATUS = {
    400: InvalidArgument,
    401: Unauthorized,
    403: Unauthorized,
    404: NotFound,
    409: Conflict,
    412: PreconditionFailed,
    413: TooLarge,
}


def from_response(status: int, body: bytes) -> SpaceError:
    """The error of a failed response: space's JSON error body, or the raw text."""
    import json

    code, message = "", body.decode("utf-8", "replace").strip() or f"HTTP {status}"
    try:
        err = json.loads(body)["error"]
        code, message = err.get("code", ""), err.get("message", message)
    except (ValueError, KeyError, TypeError):
        pass
    return _BY_STATUS.get(status, SpaceError)(status, code, message)


def from_event(event: dict) -> SpaceError:
    """The error of an `{"type": "error", "code", "message"}` stream line."""
    return SpaceError(None, str(event.get("code", "")), str(event.get("message", "stream failed")))
