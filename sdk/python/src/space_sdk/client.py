"""The synchronous client: :class:`Space`, and :class:`Sandbox` for one sandbox."""

import json
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Union

import httpx

from . import _core, errors
from ._core import Cmd, sid
from .models import (
    Change,
    EntryInfo,
    Event,
    ExecEvent,
    ExecResult,
    Metrics,
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


class _Http:
    """One httpx client with the key, turning error answers into :class:`SpaceError`s."""

    def __init__(self, url: Optional[str], api_key: Optional[str], timeout: float):
        self.url, key = _core.config(url, api_key)
        self.client = httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {key}"},
            timeout=httpx.Timeout(timeout, read=None),
        )

    def call(self, method: str, path: str, ok: Sequence[int] = (200,), **kw: Any) -> httpx.Response:
        r = self.client.request(method, path, **kw)
        if r.status_code not in ok:
            raise errors.from_response(r.status_code, r.content)
        return r

    def json(self, method: str, path: str, ok: Sequence[int] = (200,), **kw: Any) -> Any:
        return self.call(method, path, ok, **kw).json()

    def lines(self, method: str, path: str, **kw: Any) -> Iterator[Dict[str, Any]]:
        """An ndjson answer, line by line, as it arrives."""
        with self.client.stream(method, path, **kw) as r:
            if r.status_code != 200:
                raise errors.from_response(r.status_code, r.read())
            for line in r.iter_lines():
                if line.strip():
                    yield json.loads(line)


class Files:
    """A sandbox's files. Paths are absolute inside the sandbox."""

    def __init__(self, http: _Http, id: str):
        self._http, self._base = http, f"/v1/sandboxes/{sid(id)}/files"

    def read(self, path: str) -> bytes:
        return self._http.call("GET", self._base, params={"path": path}).content

    def read_text(self, path: str, encoding: str = "utf-8") -> str:
        return self.read(path).decode(encoding)

    def iter_read(self, path: str, chunk_size: int = 1 << 20) -> Iterator[bytes]:
        """The file's bytes as they stream, without holding it whole."""
        with self._http.client.stream("GET", self._base, params={"path": path}) as r:
            if r.status_code != 200:
                raise errors.from_response(r.status_code, r.read())
            yield from r.iter_bytes(chunk_size)

    def write(
        self,
        path: str,
        data: Union[bytes, str, Iterable[bytes]],
        mode: Optional[int] = None,
        parents: bool = False,
        user: Optional[str] = None,
    ) -> EntryInfo:
        """Writes (replaces) a file, streamed; it appears whole at ``path`` or not at all."""
        q = _core.params(path=path, mode=f"{mode:o}" if mode is not None else None, parents=parents, user=user)
        r = self._http.json("PUT", self._base, params=q, content=_core.chunks(data))
        return EntryInfo.from_dict(r)

    def stat(self, path: str) -> EntryInfo:
        return EntryInfo.from_dict(self._http.json("GET", f"{self._base}/stat", params={"path": path}))

    def exists(self, path: str) -> bool:
        try:
            self.stat(path)
            return True
        except errors.NotFound:
            return False

    def list(self, path: str, depth: int = 1) -> List[EntryInfo]:
        r = self._http.json("GET", f"{self._base}/list", params={"path": path, "depth": depth})
        return [EntryInfo.from_dict(e) for e in r["entries"]]

    def mkdir(self, path: str, parents: bool = False, mode: Optional[int] = None, user: Optional[str] = None) -> EntryInfo:
        body: Dict[str, Any] = {"path": path, "parents": parents}
        if mode is not None:
            body["mode"] = mode
        if user:
            body["user"] = user
        return EntryInfo.from_dict(self._http.json("POST", f"{self._base}/mkdir", ok=(201,), json=body))

    def rename(self, src: str, dst: str, overwrite: bool = False) -> EntryInfo:
        body = {"from": src, "to": dst, "overwrite": overwrite}
        return EntryInfo.from_dict(self._http.json("POST", f"{self._base}/rename", json=body))

    def remove(self, path: str, recursive: bool = False) -> None:
        self._http.call("DELETE", self._base, ok=(204,), params=_core.params(path=path, recursive=recursive))

    def watch(self, path: str, recursive: bool = False) -> Iterator[WatchEvent]:
        """Changes under a directory as they happen; the first event is ``started``. Close the
        iterator (or leave the loop) to stop watching."""
        q = _core.params(path=path, recursive=recursive)
        for line in self._http.lines("GET", f"{self._base}/watch", params=q):
            yield WatchEvent.from_dict(line)


class Sandbox:
    """One sandbox. Made by :meth:`Space.create`, :meth:`Space.get` or :meth:`Sandbox.fork`;
    a ``with`` block deletes it at its end."""

    def __init__(self, http: _Http, info: SandboxInfo):
        self._http = http
        self.id = info.id
        self.info = info
        self._base = f"/v1/sandboxes/{sid(self.id)}"
        self.files = Files(http, self.id)

    def __repr__(self) -> str:
        return f"Sandbox({self.id!r}, state={self.info.state!r})"

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.kill()
        except errors.NotFound:
            pass

    def _info(self, r: Any) -> SandboxInfo:
        self.info = SandboxInfo.from_dict(r)
        return self.info

    def refresh(self) -> SandboxInfo:
        return self._info(self._http.json("GET", self._base))

    def kill(self) -> None:
        """Deletes the sandbox: its processes, filesystem and snapshots."""
        self._http.call("DELETE", self._base, ok=(204,))

    # ---- processes ----

    def exec_stream(self, cmd: Cmd, **kw: Any) -> Iterator[ExecEvent]:
        """Runs a command in the foreground, yielding its events as they happen (started,
        stdout/stderr/pty with byte offsets, exit). Options as :meth:`run`."""
        for line in self._http.lines("POST", f"{self._base}/exec", json=_core.exec_body(cmd, **kw)):
            yield _core.event(line)

    def run(
        self,
        cmd: Cmd,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        user: Optional[str] = None,
        stdin: Union[None, bytes, str] = None,
        tag: Optional[str] = None,
        tty: bool = False,
        check: bool = False,
        on_stdout: Optional[Callable[[bytes], None]] = None,
        on_stderr: Optional[Callable[[bytes], None]] = None,
    ) -> ExecResult:
        """Runs a command to its end and returns its output and exit code. A string runs with
        ``/bin/sh -c``; a list is the argv. ``check=True`` raises :class:`ExecError` unless it
        exits 0. Nothing is lost: a slow reader holds the command back, as a pipe would."""
        c = _core.Collector()
        opts = dict(env=env, cwd=cwd, user=user, stdin=stdin, tag=tag, tty=tty)
        for e in self.exec_stream(cmd, **opts):
            c.add(e)
            if e.type in ("stdout", "pty") and on_stdout:
                on_stdout(e.data)
            elif e.type == "stderr" and on_stderr:
                on_stderr(e.data)
        result = c.result()
        if check and not result.ok:
            raise errors.ExecError(result)
        return result

    def start(self, cmd: Cmd, **kw: Any) -> int:
        """Starts a command in the background and returns its pid; :meth:`output` follows it,
        from any byte offset, across disconnects. ``keep_stdin=True`` keeps its stdin open."""
        body = _core.exec_body(cmd, background=True, **kw)
        return int(self._http.json("POST", f"{self._base}/exec", ok=(201,), json=body)["pid"])

    def output(self, pid: int, offset: int = 0, follow: bool = True) -> Iterator[ExecEvent]:
        """A process's output from byte ``offset`` (a reconnect gives exactly what was missed,
        or a ``gap`` event for what the bounded buffer no longer holds), then its exit."""
        q = _core.params(offset=offset, follow=follow)
        for line in self._http.lines("GET", f"{self._base}/processes/{pid}/output", params=q):
            yield _core.event(line)

    def wait(self, pid: int) -> ExecResult:
        """The whole output and the exit of a process started with :meth:`start`."""
        c = _core.Collector()
        c.pid = pid
        for e in self.output(pid):
            c.add(e)
        return c.result()

    def processes(self) -> List[ProcessInfo]:
        r = self._http.json("GET", f"{self._base}/processes")
        return [ProcessInfo.from_dict(p) for p in r["processes"]]

    def write_stdin(self, pid: int, data: Union[bytes, str]) -> None:
        self._http.call("POST", f"{self._base}/processes/{pid}/stdin", ok=(204,), content=_core.chunks(data))

    def close_stdin(self, pid: int) -> None:
        self._http.call("POST", f"{self._base}/processes/{pid}/stdin/close", ok=(204,))

    def signal(self, pid: int, signal: Union[str, int] = "TERM") -> None:
        self._http.call("POST", f"{self._base}/processes/{pid}/signal", ok=(204,), json={"signal": signal})

    def resize(self, pid: int, rows: int, cols: int) -> None:
        self._http.call("POST", f"{self._base}/processes/{pid}/resize", ok=(204,), json={"rows": rows, "cols": cols})

    # ---- lifecycle ----

    def pause(self, memory: bool = True) -> SandboxInfo:
        """Freezes every process (no CPU, memory kept). ``memory=False`` keeps only the
        filesystem: every process ends, and the sandbox is ``stopped`` until :meth:`resume`
        starts it again, cold."""
        body = {} if memory else {"memory": False}
        return self._info(self._http.json("POST", f"{self._base}/pause", json=body))

    def resume(self) -> SandboxInfo:
        """Thaws a paused sandbox, or starts a stopped one again on its filesystem."""
        return self._info(self._http.json("POST", f"{self._base}/resume"))

    def set_timeout(self, secs: Optional[int], on_timeout: Optional[str] = None) -> SandboxInfo:
        """The deadline becomes now + ``secs`` (None clears it); ``on_timeout`` is pause or
        delete. Nothing else ever moves a deadline."""
        body: Dict[str, Any] = {"timeout_secs": secs}
        if on_timeout:
            body["on_timeout"] = on_timeout
        return self._info(self._http.json("POST", f"{self._base}/timeout", json=body))

    def set_network(self, egress: Optional[str] = None, allow: Optional[Sequence[str]] = None) -> SandboxInfo:
        """Replaces the egress policy (none, allowlist or open; allow rules are CIDRs,
        addresses, domains and ``*.domain``). Connections it no longer allows are cut."""
        body = _core.network_body(egress, allow)
        return self._info(self._http.json("PUT", f"{self._base}/network", json=body))

    def set_snapshot_policy(self, **policy: Any) -> SandboxInfo:
        """``every_secs``, ``after_exec``, ``keep_last``, ``keep_labelled``; none removes it."""
        return self._info(self._http.json("PUT", f"{self._base}/snapshot-policy", json=policy))

    def port_url(self, port: int) -> str:
        """A URL that reaches ``port`` inside (HTTP and WebSocket); the URL is the credential."""
        return str(self._http.json("POST", f"{self._base}/ports", json={"port": port})["url"])

    def events(self, after: Optional[int] = None, limit: Optional[int] = None) -> List[Event]:
        """The sandbox's events and audit records, oldest first."""
        r = self._http.json("GET", f"{self._base}/events", params=_core.params(after=after, limit=limit))
        return [Event.from_dict(e) for e in r["events"]]

    def metrics(self, since: Optional[str] = None, until: Optional[str] = None) -> Metrics:
        r = self._http.json("GET", f"{self._base}/metrics", params=_core.params(since=since, until=until))
        return Metrics.from_dict(r)

    # ---- snapshots ----

    def snapshot(self, label: Optional[str] = None, checkpoint: bool = False) -> Snapshot:
        """An atomic snapshot of the filesystem (``checkpoint=True`` also records the running
        processes, restarted after a rollback or fork; a microvm keeps their memory)."""
        body: Dict[str, Any] = {"kind": "checkpoint" if checkpoint else "disk"}
        if label:
            body["label"] = label
        return Snapshot.from_dict(self._http.json("POST", f"{self._base}/snapshots", ok=(201,), json=body))

    def snapshots(self) -> List[Snapshot]:
        r = self._http.json("GET", f"{self._base}/snapshots")
        return [Snapshot.from_dict(s) for s in r["snapshots"]]

    def delete_snapshot(self, snapshot: str) -> None:
        self._http.call("DELETE", f"{self._base}/snapshots/{sid(snapshot)}", ok=(204,))

    def rollback(self, snapshot: str) -> SandboxInfo:
        """Puts the filesystem back as it was at ``snapshot``; processes restart fresh."""
        return self._info(self._http.json("POST", f"{self._base}/rollback", json={"snapshot": snapshot}))

    def fork(self, snapshot: Optional[str] = None, count: int = 1) -> List["Sandbox"]:
        """New sandboxes from a snapshot (by default one taken now), each with its own identity."""
        body: Dict[str, Any] = {"count": count}
        if snapshot:
            body["snapshot"] = snapshot
        r = self._http.json("POST", f"{self._base}/fork", ok=(201,), json=body)
        return [Sandbox(self._http, SandboxInfo.from_dict(s)) for s in r["sandboxes"]]

    def diff(self, since: Optional[str] = None, until: Optional[str] = None) -> List[Change]:
        """Paths added, modified and deleted between two snapshots (``since`` absent: the
        sandbox's creation; ``until`` absent: the live filesystem)."""
        q = _core.params(**{"from": since, "to": until})
        return [Change.from_dict(c) for c in self._http.json("GET", f"{self._base}/diff", params=q)["changes"]]


class Templates:
    def __init__(self, http: _Http):
        self._http = http

    def list(self) -> List[Template]:
        return [Template.from_dict(t) for t in self._http.json("GET", "/v1/templates")["templates"]]

    def get(self, name: str) -> TemplateDetail:
        return TemplateDetail.from_dict(self._http.json("GET", f"/v1/templates/{sid(name)}"))

    def remove(self, name: str, version: Optional[int] = None) -> List[int]:
        """Removes one version, or all; refused (Conflict) while a sandbox uses one."""
        r = self._http.json("DELETE", f"/v1/templates/{sid(name)}", params=_core.params(version=version))
        return list(r["versions"])

    def _finish(self, lines: Iterator[Dict[str, Any]], on_log: Optional[Callable[[TemplateLog], None]]) -> Template:
        for line in lines:
            if line.get("type") == "error":
                err = line.get("error") or {}
                raise errors.SpaceError(None, err.get("code", ""), err.get("message", "failed"))
            log = TemplateLog.from_dict(line)
            if on_log:
                on_log(log)
            if log.type == "done" and log.template:
                return log.template
        raise errors.SpaceError(None, "stream_ended", "the progress stream ended without a result")

    def pull(
        self,
        name: str,
        reference: str,
        username: Optional[str] = None,
        password: Optional[str] = None,
        insecure: bool = False,
        replace: bool = False,
        on_log: Optional[Callable[[TemplateLog], None]] = None,
    ) -> Template:
        """Pulls an OCI image into a new version of template ``name``; ``on_log`` sees the
        progress lines."""
        body: Dict[str, Any] = {"reference": reference, "insecure": insecure, "replace": replace}
        if username is not None:
            body["username"] = username
        if password is not None:
            body["password"] = password
        return self._finish(self._http.lines("POST", f"/v1/templates/{sid(name)}/pull", json=body), on_log)

    def build(
        self,
        name: str,
        context: Any,
        dockerfile: Optional[str] = None,
        build_args: Optional[Mapping[str, str]] = None,
        no_cache: bool = False,
        replace: bool = False,
        egress: Optional[str] = None,
        on_log: Optional[Callable[[TemplateLog], None]] = None,
    ) -> Template:
        """Builds template ``name`` from a Dockerfile. ``context`` is a directory (packed
        without what its ``.dockerignore`` excludes) or tar bytes. Every RUN runs in a sandbox."""
        tar, df = _core.context_tar(context, dockerfile)
        q: List[Any] = list(_core.params(dockerfile=df, no_cache=no_cache, replace=replace, egress=egress).items())
        q += [("build_arg", f"{k}={v}") for k, v in (build_args or {}).items()]
        lines = self._http.lines(
            "POST", f"/v1/templates/{sid(name)}/build", params=q, content=tar,
            headers={"Content-Type": "application/x-tar"},
        )
        return self._finish(lines, on_log)

    def set_start(self, name: str, start_cmd: Optional[str] = None, ready_cmd: Optional[str] = None, ready_timeout_secs: Optional[int] = None) -> Template:
        body = {k: v for k, v in [("start_cmd", start_cmd), ("ready_cmd", ready_cmd), ("ready_timeout_secs", ready_timeout_secs)] if v is not None}
        return Template.from_dict(self._http.json("PUT", f"/v1/templates/{sid(name)}/start", json=body))

    def from_snapshot(self, name: str, sandbox: str, snapshot: str) -> Template:
        """A template made of a sandbox's snapshot, with no copy."""
        body = {"sandbox": sandbox, "snapshot": snapshot}
        return Template.from_dict(self._http.json("POST", f"/v1/templates/{sid(name)}/from-snapshot", ok=(200, 201), json=body))


class Secrets:
    def __init__(self, http: _Http):
        self._http = http

    def set(self, name: str, value: str, hosts: Sequence[str], header: str) -> SecretInfo:
        """Creates or replaces a secret that sandboxes see only as a placeholder, which the
        egress proxy replaces in ``header`` (``"Authorization: Bearer {}"``) for ``hosts``."""
        body = {"value": value, "hosts": list(hosts), "header": header}
        return SecretInfo.from_dict(self._http.json("PUT", f"/v1/secrets/{sid(name)}", json=body))

    def get(self, name: str) -> SecretInfo:
        return SecretInfo.from_dict(self._http.json("GET", f"/v1/secrets/{sid(name)}"))

    def list(self) -> List[SecretInfo]:
        return [SecretInfo.from_dict(s) for s in self._http.json("GET", "/v1/secrets")["secrets"]]

    def delete(self, name: str) -> None:
        self._http.call("DELETE", f"/v1/secrets/{sid(name)}", ok=(204,))


class Pools:
    def __init__(self, http: _Http):
        self._http = http

    def list(self) -> List[Pool]:
        return [Pool.from_dict(p) for p in self._http.json("GET", "/v1/pools")["pools"]]

    def get(self, template: str) -> Pool:
        return Pool.from_dict(self._http.json("GET", f"/v1/templates/{sid(template)}/pool"))

    def set(self, template: str, min: int, max: Optional[int] = None, runtime: Optional[str] = None) -> Pool:
        """Keeps ``min`` ready sandboxes of ``template`` (0 turns the pool off), growing toward
        ``max`` under load."""
        body: Dict[str, Any] = {"min": min}
        if max is not None:
            body["max"] = max
        if runtime:
            body["runtime"] = runtime
        return Pool.from_dict(self._http.json("PUT", f"/v1/templates/{sid(template)}/pool", json=body))


class Space:
    """A connection to spaced. ``url`` and ``api_key`` default to ``SPACE_URL`` and
    ``SPACE_API_KEY`` (then ``http://127.0.0.1:7070`` and the admin key file)."""

    def __init__(self, url: Optional[str] = None, api_key: Optional[str] = None, timeout: float = 60.0):
        self._http = _Http(url, api_key, timeout)
        self.templates = Templates(self._http)
        self.secrets = Secrets(self._http)
        self.pools = Pools(self._http)

    def close(self) -> None:
        self._http.client.close()

    def __enter__(self) -> "Space":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def health(self) -> Dict[str, Any]:
        return dict(self._http.json("GET", "/healthz"))

    def e2b_settings(self) -> Dict[str, Any]:
        """``GET /v1/e2b``: the server's E2B domain (``--e2b-domain``) and the CA (PEM) of
        the certificates it issues for it; each None when there is none."""
        return dict(self._http.json("GET", "/v1/e2b"))

    def create(self, template: Optional[str] = None, *, secret_headers: Optional[Sequence[SecretHeader]] = None, **kw: Any) -> Sandbox:
        """A new sandbox, running when this returns. Keywords: ``cpu``, ``memory_mib``,
        ``pids``, ``env``, ``metadata``, ``hostname``, ``timeout_secs``, ``on_timeout``,
        ``auto_pause_secs``, ``snapshot_policy``, ``egress``, ``allow``, ``secrets``,
        ``secret_headers`` and ``runtime``."""
        body = _core.create_body(template=template, secret_headers=secret_headers, **kw)
        info = SandboxInfo.from_dict(self._http.json("POST", "/v1/sandboxes", ok=(201,), json=body))
        return Sandbox(self._http, info)

    def get(self, id: str) -> Sandbox:
        return Sandbox(self._http, SandboxInfo.from_dict(self._http.json("GET", f"/v1/sandboxes/{sid(id)}")))

    def list(self) -> List[Sandbox]:
        r = self._http.json("GET", "/v1/sandboxes")
        return [Sandbox(self._http, SandboxInfo.from_dict(s)) for s in r["sandboxes"]]
