"""What the sync and async clients share: configuration, request bodies and answers' parsing.
No I/O here."""

import base64
import fnmatch
import io
import os
import tarfile
from dataclasses import asdict
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union
from urllib.parse import quote

from . import errors
from .models import ExecEvent, ExecResult, SecretHeader

DEFAULT_URL = "http://127.0.0.1:7070"
Cmd = Union[str, Sequence[str]]


def config(url: Optional[str], api_key: Optional[str]) -> Tuple[str, str]:
    """The address and key: the arguments, else ``SPACE_URL`` and ``SPACE_API_KEY``, else the
    default address and the admin key spaced wrote (``$SPACE_DATA_DIR/admin.key``), as the
    ``space`` CLI takes them."""
    url = (url or os.environ.get("SPACE_URL") or DEFAULT_URL).rstrip("/")
    key = api_key or os.environ.get("SPACE_API_KEY")
    if not key:
        path = os.path.join(os.environ.get("SPACE_DATA_DIR", "/var/lib/space"), "admin.key")
        try:
            with open(path) as f:
                key = f.read().strip()
        except OSError:
            raise errors.Unauthorized(
                None,
                "no_key",
                f"no API key: pass api_key, set SPACE_API_KEY, or make {path} readable",
            ) from None
    return url, key


def sid(id: str) -> str:
    """A path segment (ids and names are checked by spaced; this only keeps them one segment)."""
    return quote(id, safe="")


def argv(cmd: Cmd) -> List[str]:
    """A string runs through ``/bin/sh -c``; a list is the argv itself."""
    if isinstance(cmd, str):
        return ["/bin/sh", "-c", cmd]
    return list(cmd)


def exec_body(
    cmd: Cmd,
    env: Optional[Mapping[str, str]] = None,
    cwd: Optional[str] = None,
    user: Optional[str] = None,
    stdin: Union[None, bytes, str] = None,
    keep_stdin: bool = False,
    tag: Optional[str] = None,
    tty: bool = False,
    rows: Optional[int] = None,
    cols: Optional[int] = None,
    background: bool = False,
) -> Dict[str, Any]:
    body: Dict[str, Any] = {"cmd": argv(cmd)}
    if env:
        body["env"] = dict(env)
    if cwd:
        body["cwd"] = cwd
    if user:
        body["user"] = user
    if stdin is not None:
        data = stdin.encode() if isinstance(stdin, str) else stdin
        body["stdin_data"] = base64.b64encode(data).decode()
    if keep_stdin:
        body["stdin"] = True
    if tag:
        body["tag"] = tag
    if tty:
        body["tty"] = True
        if rows:
            body["rows"] = rows
        if cols:
            body["cols"] = cols
    if background:
        body["background"] = True
    return body


def create_body(
    template: Optional[str] = None,
    cpu: Optional[float] = None,
    memory_mib: Optional[int] = None,
    pids: Optional[int] = None,
    env: Optional[Mapping[str, str]] = None,
    metadata: Optional[Mapping[str, str]] = None,
    hostname: Optional[str] = None,
    timeout_secs: Optional[int] = None,
    on_timeout: Optional[str] = None,
    auto_pause_secs: Optional[int] = None,
    snapshot_policy: Optional[Mapping[str, Any]] = None,
    egress: Optional[str] = None,
    allow: Optional[Sequence[str]] = None,
    secrets: Optional[Sequence[str]] = None,
    secret_headers: Optional[Sequence[SecretHeader]] = None,
    runtime: Optional[str] = None,
) -> Dict[str, Any]:
    body: Dict[str, Any] = {}
    for k, v in [
        ("template", template),
        ("cpu", cpu),
        ("memory_mib", memory_mib),
        ("pids", pids),
        ("hostname", hostname),
        ("timeout_secs", timeout_secs),
        ("on_timeout", on_timeout),
        ("auto_pause_secs", auto_pause_secs),
        ("runtime", runtime),
    ]:
        if v is not None:
            body[k] = v
    if env:
        body["env"] = dict(env)
    if metadata:
        body["metadata"] = dict(metadata)
    if snapshot_policy:
        body["snapshot_policy"] = dict(snapshot_policy)
    network = network_body(egress, allow)
    if network:
        body["network"] = network
    if secrets:
        body["secrets"] = list(secrets)
    if secret_headers:
        body["secret_headers"] = [asdict(h) for h in secret_headers]
    return body


def network_body(egress: Optional[str], allow: Optional[Sequence[str]]) -> Dict[str, Any]:
    body: Dict[str, Any] = {}
    if egress is not None:
        body["egress"] = egress
    if allow:
        body["allow"] = list(allow)
    return body


def params(**kw: Any) -> Dict[str, Any]:
    """Query parameters, without the ones not given; booleans as spaced reads them."""
    out: Dict[str, Any] = {}
    for k, v in kw.items():
        if v is None:
            continue
        out[k] = ("true" if v else "false") if isinstance(v, bool) else v
    return out


def event(line: Dict[str, Any]) -> ExecEvent:
    """An exec/output stream line, or the error it reports, raised."""
    if line.get("type") == "error":
        raise errors.from_event(line)
    return ExecEvent.from_dict(line)


class Collector:
    """Gathers a foreground command's stream into an :class:`ExecResult`."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.err = bytearray()
        self.pid: Optional[int] = None
        self.code: Optional[int] = None
        self.signal: Optional[int] = None
        self.ended = False

    def add(self, e: ExecEvent) -> None:
        if e.type == "started":
            self.pid = e.pid
        elif e.type in ("stdout", "pty"):
            self.out += e.data
        elif e.type == "stderr":
            self.err += e.data
        elif e.type == "exit":
            self.code, self.signal, self.ended = e.code, e.signal, True

    def result(self) -> ExecResult:
        if not self.ended:
            raise errors.SpaceError(None, "stream_ended", "the exec stream ended before the exit")
        out, err = bytes(self.out), bytes(self.err)
        return ExecResult(
            stdout=out.decode("utf-8", "replace"),
            stderr=err.decode("utf-8", "replace"),
            exit_code=self.code,
            signal=self.signal,
            pid=self.pid,
            stdout_bytes=out,
            stderr_bytes=err,
        )


def ignored(rel: str, patterns: List[Tuple[bool, str]]) -> bool:
    """Whether `.dockerignore` excludes `rel` (patterns in order; `!` re-includes; a pattern
    that matches a directory excludes what is under it)."""
    out = False
    parts = rel.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for negate, pat in patterns:
        if any(fnmatch.fnmatchcase(p, pat) for p in prefixes):
            out = not negate
    return out


def context_tar(
    context: Union[str, bytes, os.PathLike], dockerfile: Optional[str]
) -> Tuple[bytes, str]:
    """A build context as tar bytes, and the Dockerfile's path in it. A directory is packed
    without what its `.dockerignore` excludes (the Dockerfile always goes in); bytes are taken
    as a tar already."""
    if isinstance(context, bytes):
        return context, dockerfile or "Dockerfile"
    root = os.fspath(context)
    patterns: List[Tuple[bool, str]] = []
    try:
        with open(os.path.join(root, ".dockerignore")) as f:
            for line in f:
                line = line.strip()
                if line and not line.startswith("#"):
                    neg = line.startswith("!")
                    patterns.append((neg, line.lstrip("!").strip("/")))
    except OSError:
        pass
    df = dockerfile or "Dockerfile"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for dirpath, dirnames, filenames in os.walk(root):
            rel_dir = os.path.relpath(dirpath, root)
            for name in sorted(filenames) + sorted(
                d for d in dirnames if os.path.islink(os.path.join(dirpath, d))
            ):
                rel = name if rel_dir == "." else f"{rel_dir}/{name}"
                if rel != df and ignored(rel, patterns):
                    continue
                tar.add(os.path.join(dirpath, name), arcname=rel, recursive=False)
            dirnames[:] = [
                d
                for d in sorted(dirnames)
                if not os.path.islink(os.path.join(dirpath, d))
                and not ignored(d if rel_dir == "." else f"{rel_dir}/{d}", patterns)
            ]
    return buf.getvalue(), df


def chunks(data: Union[bytes, str, Iterable[bytes]]) -> Union[bytes, Iterable[bytes]]:
    return data.encode() if isinstance(data, str) else data
