"""space-sdk: the Python SDK of space, secure and stateful sandboxes for AI agents.

Sync::

    from space_sdk import Space
    with Space() as space:                        # SPACE_URL, SPACE_API_KEY
        with space.create("base") as sbx:         # deleted at the end of the block
            print(sbx.run("python3 -V").stdout)
            snap = sbx.snapshot(label="clean")
            sbx.run("rm -rf /home/user/*")
            sbx.rollback(snap.id)                  # the files are back

Async: ``AsyncSpace`` and ``AsyncSandbox``, the same calls awaited.
"""

from .aio import AsyncFiles, AsyncSandbox, AsyncSpace
from .client import Files, Sandbox, Space
from .errors import (
    Conflict,
    ExecError,
    InvalidArgument,
    NotFound,
    PreconditionFailed,
    SpaceError,
    TooLarge,
    Unauthorized,
)
from .models import (
    Change,
    EntryInfo,
    Event,
    ExecEvent,
    ExecResult,
    Metrics,
    MetricsSample,
    NetworkInfo,
    Pool,
    ProcessInfo,
    SandboxInfo,
    SecretHeader,
    SecretInfo,
    Snapshot,
    Template,
    TemplateDetail,
    TemplateLog,
    WatchEvent,
)

__version__ = "0.1.0"

__all__ = [
    "AsyncFiles",
    "AsyncSandbox",
    "AsyncSpace",
    "Change",
    "Conflict",
    "EntryInfo",
    "Event",
    "ExecError",
    "ExecEvent",
    "ExecResult",
    "Files",
    "InvalidArgument",
    "Metrics",
    "MetricsSample",
    "NetworkInfo",
    "NotFound",
    "Pool",
    "PreconditionFailed",
    "ProcessInfo",
    "Sandbox",
    "SandboxInfo",
    "SecretHeader",
    "SecretInfo",
    "Snapshot",
    "Space",
    "SpaceError",
    "Template",
    "TemplateDetail",
    "TemplateLog",
    "TooLarge",
    "Unauthorized",
    "WatchEvent",
]
