"""Typed models of the REST API's answers (`api/openapi.yaml`).

Every model is a frozen dataclass built with ``from_dict``, which ignores fields it does not
know, so that an older SDK keeps working against a newer spaced.
"""

import base64
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Type, TypeVar

M = TypeVar("M", bound="_Model")


class _Model:
    """A model built from an answer's JSON by ``from_dict``: fields it does not know are
    ignored; ``_nested`` builds the fields that hold other models."""

    @classmethod
    def from_dict(cls: Type[M], d: Dict[str, Any]) -> M:
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        kw = {k: v for k, v in d.items() if k in names}
        kw.update(cls._nested(d))
        return cls(**kw)

    @classmethod
    def _nested(cls, d: Dict[str, Any]) -> Dict[str, Any]:
        return {}


@dataclass(frozen=True)
class NetworkInfo(_Model):
    """A sandbox's egress policy, and its address while it runs."""

    egress: str
    allow: List[str] = field(default_factory=list)
    address: Optional[str] = None
    gateway: Optional[str] = None


@dataclass(frozen=True)
class SandboxInfo(_Model):
    """A sandbox as `GET /v1/sandboxes/{id}` shows it."""

    id: str
    template: str
    runtime: str
    state: str
    created_at: str
    cpu: float
    memory_mib: int
    pids: int
    hostname: str
    env: Dict[str, str] = field(default_factory=dict)
    metadata: Dict[str, str] = field(default_factory=dict)
    error: Optional[str] = None
    timeout_at: Optional[str] = None
    on_timeout: Optional[str] = None
    auto_pause_secs: Optional[int] = None
    paused_at: Optional[str] = None
    memory_bytes: Optional[int] = None
    cpu_usage_usec: Optional[int] = None
    snapshot_policy: Optional[Dict[str, Any]] = None
    network: Optional[NetworkInfo] = None
    secrets: List[str] = field(default_factory=list)
    pooled: bool = False
    restored: bool = False
    node_unreachable: bool = False

    @classmethod
    def _nested(cls, d: Dict[str, Any]) -> Dict[str, Any]:
        net = d.get("network")
        return {"network": NetworkInfo.from_dict(net) if net else None}


@dataclass(frozen=True)
class Snapshot(_Model):
    id: str
    sandbox_id: str
    created_at: str
    kind: str
    parent_id: Optional[str] = None
    label: Optional[str] = None
    size_bytes: Optional[int] = None
    auto: bool = False
    memory: bool = False


@dataclass(frozen=True)
class Change(_Model):
    """One path of a diff: ``change`` is added, modified or deleted; ``type`` file or dir."""

    path: str
    change: str
    type: str


@dataclass(frozen=True)
class EntryInfo(_Model):
    """A file, directory, symlink or other entry inside a sandbox."""

    name: str
    path: str
    type: str
    size: int
    mode: int
    uid: int
    gid: int
    modified_at: str
    owner: Optional[str] = None
    group: Optional[str] = None
    symlink_target: Optional[str] = None
    mount_point: bool = False
    metadata: Dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ProcessInfo(_Model):
    pid: int
    cmd: List[str]
    tag: str
    tty: bool
    running: bool
    started_at: str
    output_bytes: int
    exit_code: Optional[int] = None
    signal: Optional[int] = None


@dataclass(frozen=True)
class ExecEvent:
    """One line of an exec or output stream.

    ``type`` is started (``pid``), stdout, stderr or pty (``offset`` and ``data``, bytes),
    gap (``start``..``end``: output the bounded buffer no longer holds), or exit (``code``
    or ``signal``). An error line raises instead of becoming an event.
    """

    type: str
    pid: Optional[int] = None
    offset: Optional[int] = None
    data: bytes = b""
    start: Optional[int] = None
    end: Optional[int] = None
    code: Optional[int] = None
    signal: Optional[int] = None

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "ExecEvent":
        return cls(
            type=d["type"],
            pid=d.get("pid"),
            offset=d.get("offset"),
            data=base64.b64decode(d["data"]) if "data" in d else b"",
            start=d.get("from"),
            end=d.get("to"),
            code=d.get("code") if isinstance(d.get("code"), int) else None,
            signal=d.get("signal"),
        )


@dataclass(frozen=True)
class ExecResult:
    """What a foreground command produced, whole."""

    stdout: str
    stderr: str
    exit_code: Optional[int]
    signal: Optional[int]
    pid: Optional[int]
    stdout_bytes: bytes = b""
    stderr_bytes: bytes = b""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


@dataclass(frozen=True)
class WatchEvent(_Model):
    """A change under a watched directory: ``type`` is started, create, write, remove, rename,
    chmod or overflow (events were lost); ``name`` is relative to the directory."""

    type: str
    name: str = ""
    is_dir: bool = False


@dataclass(frozen=True)
class Event(_Model):
    """An event or audit record of a sandbox."""

    id: int
    time: int
    actor: str
    sandbox_id: str
    action: str
    result: str
    detail: Optional[str] = None


@dataclass(frozen=True)
class MetricsSample(_Model):
    time: str
    cpu_pct: float
    memory_bytes: int
    memory_cache_bytes: int


@dataclass(frozen=True)
class Metrics(_Model):
    cpu: float
    memory_limit_bytes: int
    samples: List[MetricsSample]
    disk_total_bytes: Optional[int] = None
    disk_used_bytes: Optional[int] = None

    @classmethod
    def _nested(cls, d: Dict[str, Any]) -> Dict[str, Any]:
        return {"samples": [MetricsSample.from_dict(s) for s in d.get("samples", [])]}


@dataclass(frozen=True)
class Template(_Model):
    name: str
    version: int
    created_at: str
    path: Optional[str] = None
    source: Optional[str] = None
    start_cmd: Optional[str] = None
    ready_cmd: Optional[str] = None
    runtime: Optional[str] = None


@dataclass(frozen=True)
class TemplateDetail(_Model):
    name: str
    versions: List[Template]
    runtime: Optional[str] = None

    @classmethod
    def _nested(cls, d: Dict[str, Any]) -> Dict[str, Any]:
        return {"versions": [Template.from_dict(v) for v in d["versions"]]}


@dataclass(frozen=True)
class TemplateLog(_Model):
    """One line of a build's or pull's progress: step (``n`` of ``of``), note, output, done
    (``template``). An error line raises instead."""

    type: str
    text: Optional[str] = None
    n: Optional[int] = None
    of: Optional[int] = None
    template: Optional[Template] = None

    @classmethod
    def _nested(cls, d: Dict[str, Any]) -> Dict[str, Any]:
        t = d.get("template")
        return {"template": Template.from_dict(t) if t else None}


@dataclass(frozen=True)
class Pool(_Model):
    template: str
    runtime: str
    min: int
    max: int
    target: int
    ready: int
    starting: int
    hits: int
    misses: int
    warning: Optional[str] = None


@dataclass(frozen=True)
class SecretInfo(_Model):
    """A secret, never its value. ``hosts`` is empty for one made through E2B's API."""

    name: str
    hosts: List[str]
    header: str
    created_at: str
    updated_at: str
    version: int = 1
    metadata: Dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class SecretHeader:
    """A header the egress proxy sets with ``secret``'s value on HTTPS requests to ``hosts``
    (``header`` is ``"Name: template with {}"``). Nothing of it enters the sandbox."""

    secret: str
    hosts: List[str]
    header: str
