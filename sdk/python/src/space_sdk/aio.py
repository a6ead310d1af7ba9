"""The asynchronous client (asyncio, httpx): :class:`AsyncSpace`, and :class:`AsyncSandbox` for
one sandbox. The same calls as the synchronous client, awaited."""

import json
from typing import Any, AsyncIterator, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Union

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
        self.client = httpx.AsyncClient(
            base_url=self.url,
            headers={"Authorization": f"Bearer {key}"},
            timeout=httpx.Timeout(timeout, read=None),
        )

    async def call(self, method: str, path: str, ok: Sequence[int] = (200,), **kw: Any) -> httpx.Response:
        r = await self.client.request(method, path, **kw)
        if r.status_code not in ok:
            raise errors.from_response(r.status_code, r.content)
        return r

    async def json(self, method: str, path: str, ok: Sequence[int] = (200,), **kw: Any) -> Any:
        return (await self.call(method, path, ok, **kw)).json()

    async def lines(self, method: str, path: str, **kw: Any) -> AsyncIterator[Dict[str, Any]]:
        """An ndjson answer, line by line, as it arrives."""
        async with self.client.stream(method, path, **kw) as r:
            if r.status_code != 200:
                raise errors.from_response(r.status_code, await r.aread())
            async for line in r.aiter_lines():
                if line.strip():
                    yield json.loads(line)


class AsyncFiles:
    """A sandbox's files. Paths are absolute inside the sandbox."""

    def __init__(self, http: _Http, id: str):
        self._http, self._base = http, f"/v1/sandboxes/{sid(id)}/files"

    async def read(self, path: str) -> bytes:
        return (await self._http.call("GET", self._base, params={"path": path})).content

    async def read_text(self, path: str, encoding: str = "utf-8") -> str:
        return (await self.read(path)).decode(encoding)

    async def iter_read(self, path: str, chunk_size: int = 1 << 20) -> AsyncIterator[bytes]:
        """The file's bytes as they stream, without holding it whole."""
        async with self._http.client.stream("GET", self._base, params={"path": path}) as r:
            if r.status_code != 200:
                raise errors.from_response(r.status_code, await r.aread())
            async for chunk in r.aiter_bytes(chunk_size):
                yield chunk

    async def write(
        self,
        path: str,
        data: Union[bytes, str, Iterable[bytes]],
        mode: Optional[int] = None,
        parents: bool = False,
        user: Optional[str] = None,
    ) -> EntryInfo:
        """Writes (replaces) a file, streamed; it appears whole at ``path`` or not at all."""
        q = _core.params(path=path, mode=f"{mode:o}" if mode is not None else None, parents=parents, user=user)
        r = await self._http.json("PUT", self._base, params=q, content=_core.chunks(data))
        return EntryInfo.from_dict(r)

    async def stat(self, path: str) -> EntryInfo:
        return EntryInfo.from_dict(await self._http.json("GET", f"{self._base}/stat", params={"path": path}))

    async def exists(self, path: str) -> bool:
        try:
            await self.stat(path)
            return True
        except errors.NotFound:
            return False

    async def list(self, path: str, depth: int = 1) -> List[EntryInfo]:
        r = await self._http.json("GET", f"{self._base}/list", params={"path": path, "depth": depth})
        return [EntryInfo.from_dict(e) for e in r["entries"]]

    async def mkdir(self, path: str, parents: bool = False, mode: Optional[int] = None, user: Optional[str] = None) -> EntryInfo:
        body: Dict[str, Any] = {"path": path, "parents": parents}
        if mode is not None:
            body["mode"] = mode
        if user:
            body["user"] = user
        return EntryInfo.from_dict(await self._http.json("POST", f"{self._base}/mkdir", ok=(201,), json=body))

    async def rename(self, src: str, dst: str, overwrite: bool = False) -> EntryInfo:
        body = {"from": src, "to": dst, "overwrite": overwrite}
        return EntryInfo.from_dict(await self._http.json("POST", f"{self._base}/rename", json=body))

    async def remove(self, path: str, recursive: bool = False) -> None:
        await self._http.call("DELETE", self._base, ok=(204,), params=_core.params(path=path, recursive=recursive))

    async def watch(self, path: str, recursive: bool = False) -> AsyncIterator[WatchEvent]:
        """Changes under a directory as they happen; the first event is ``started``. Close the
        iterator (or leave the loop) to stop watching."""
        q = _core.params(path=path, recursive=recursive)
        async for line in self._http.lines("GET", f"{self._base}/watch", params=q):
            yield WatchEvent.from_dict(line)


class AsyncSandbox:
    """One sandbox. Made by :meth:`AsyncSpace.create`, :meth:`AsyncSpace.get` or :meth:`AsyncSandbox.fork`;
    a ``with`` block deletes it at its end."""

    def __init__(self, http: _Http, info: SandboxInfo):
        self._http = http
        self.id = info.id
        self.info = info
        self._base = f"/v1/sandboxes/{sid(self.id)}"
        self.files = AsyncFiles(http, self.id)

    def __repr__(self) -> str:
        return f"AsyncSandbox({self.id!r}, state={self.info.state!r})"

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        try:
            await self.kill()
        except errors.NotFound:
            pass

    def _info(self, r: Any) -> SandboxInfo:
        self.info = SandboxInfo.from_dict(r)
        return self.info

    async def refresh(self) -> SandboxInfo:
        return self._info(await self._http.json("GET", self._base))

    async def kill(self) -> None:
        """Deletes the sandbox: its processes, filesystem and snapshots."""
        await self._http.call("DELETE", self._base, ok=(204,))

    # ---- processes ----

    async def exec_stream(self, cmd: Cmd, **kw: Any) -> AsyncIterator[ExecEvent]:
        """Runs a command in the foreground, yielding its events as they happen (started,
        stdout/stderr/pty with byte offsets, exit). Options as :meth:`run`."""
        async for line in self._http.lines("POST", f"{self._base}/exec", json=_core.exec_body(cmd, **kw)):
            yield _core.event(line)

    async def run(
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
        async for e in self.exec_stream(cmd, **opts):
            c.add(e)
            if e.type in ("stdout", "pty") and on_stdout:
                on_stdout(e.data)
            elif e.type == "stderr" and on_stderr:
                on_stderr(e.data)
        result = c.result()
        if check and not result.ok:
            raise errors.ExecError(result)
        return result

    async def start(self, cmd: Cmd, **kw: Any) -> int:
        """Starts a command in the background and returns its pid; :meth:`output` follows it,
        from any byte offset, across disconnects. ``keep_stdin=True`` keeps its stdin open."""
        body = _core.exec_body(cmd, background=True, **kw)
        return int((await self._http.json("POST", f"{self._base}/exec", ok=(201,), json=body))["pid"])

    async def output(self, pid: int, offset: int = 0, follow: bool = True) -> AsyncIterator[ExecEvent]:
        """A process's output from byte ``offset`` (a reconnect gives exactly what was missed,
        or a ``gap`` event for what the bounded buffer no longer holds), then its exit."""
        q = _core.params(offset=offset, follow=follow)
        async for line in self._http.lines("GET", f"{self._base}/processes/{pid}/output", params=q):
            yield _core.event(line)

    async def wait(self, pid: int) -> ExecResult:
        """The whole output and the exit of a process started with :meth:`start`."""
        c = _core.Collector()
        c.pid = pid
        async for e in self.output(pid):
            c.add(e)
        return c.result()

    async def processes(self) -> List[ProcessInfo]:
        r = await self._http.json("GET", f"{self._base}/processes")
        return [ProcessInfo.from_dict(p) for p in r["processes"]]

    async def write_stdin(self, pid: int, data: Union[bytes, str]) -> None:
        await self._http.call("POST", f"{self._base}/processes/{pid}/stdin", ok=(204,), content=_core.chunks(data))

    async def close_stdin(self, pid: int) -> None:
        await self._http.call("POST", f"{self._base}/processes/{pid}/stdin/close", ok=(204,))

    async def signal(self, pid: int, signal: Union[str, int] = "TERM") -> None:
        await self._http.call("POST", f"{self._base}/processes/{pid}/signal", ok=(204,), json={"signal": signal})

    async def resize(self, pid: int, rows: int, cols: int) -> None:
        await self._http.call("POST", f"{self._base}/processes/{pid}/resize", ok=(204,), json={"rows": rows, "cols": cols})

    # ---- lifecycle ----

    async def pause(self, memory: bool = True) -> SandboxInfo:
        """Freezes every process (no CPU, memory kept). ``memory=False`` keeps only the
        filesystem: every process ends, and the sandbox is ``stopped`` until :meth:`resume`
        starts it again, cold."""
        body = {} if memory else {"memory": False}
        return self._info(await self._http.json("POST", f"{self._base}/pause", json=body))

    async def resume(self) -> SandboxInfo:
        """Thaws a paused sandbox, or starts a stopped one again on its filesystem."""
        return self._info(await self._http.json("POST", f"{self._base}/resume"))

    async def set_timeout(self, secs: Optional[int], on_timeout: Optional[str] = None) -> SandboxInfo:
        """The deadline becomes now + ``secs`` (None clears it); ``on_timeout`` is pause or
        delete. Nothing else ever moves a deadline."""
        body: Dict[str, Any] = {"timeout_secs": secs}
        if on_timeout:
            body["on_timeout"] = on_timeout
        return self._info(await self._http.json("POST", f"{self._base}/timeout", json=body))

    async def set_network(self, egress: Optional[str] = None, allow: Optional[Sequence[str]] = None) -> SandboxInfo:
        """Replaces the egress policy (none, allowlist or open; allow rules are CIDRs,
        addresses, domains and ``*.domain``). Connections it no longer allows are cut."""
        body = _core.network_body(egress, allow)
        return self._info(await self._http.json("PUT", f"{self._base}/network", json=body))

    async def set_snapshot_policy(self, **policy: Any) -> SandboxInfo:
        """``every_secs``, ``after_exec``, ``keep_last``, ``keep_labelled``; none removes it."""
        return self._info(await self._http.json("PUT", f"{self._base}/snapshot-policy", json=policy))

    async def port_url(self, port: int) -> str:
        """A URL that reaches ``port`` inside (HTTP and WebSocket); the URL is the credential."""
        return str((await self._http.json("POST", f"{self._base}/ports", json={"port": port}))["url"])

    async def events(self, after: Optional[int] = None, limit: Optional[int] = None) -> List[Event]:
        """The sandbox's events and audit records, oldest first."""
        r = await self._http.json("GET", f"{self._base}/events", params=_core.params(after=after, limit=limit))
        return [Event.from_dict(e) for e in r["events"]]

    async def metrics(self, since: Optional[str] = None, until: Optional[str] = None) -> Metrics:
        r = await self._http.json("GET", f"{self._base}/metrics", params=_core.params(since=since, until=until))
        return Metrics.from_dict(r)

    # ---- snapshots ----

    async def snapshot(self, label: Optional[str] = None, checkpoint: bool = False) -> Snapshot:
        """An atomic snapshot of the filesystem (``checkpoint=True`` also records the running
        processes, restarted after a rollback or fork; a microvm keeps their memory)."""
        body: Dict[str, Any] = {"kind": "checkpoint" if checkpoint else "disk"}
        if label:
            body["label"] = label
        return Snapshot.from_dict(await self._http.json("POST", f"{self._base}/snapshots", ok=(201,), json=body))

    async def snapshots(self) -> List[Snapshot]:
        r = await self._http.json("GET", f"{self._base}/snapshots")
        return [Snapshot.from_dict(s) for s in r["snapshots"]]

    async def delete_snapshot(self, snapshot: str) -> None:
        await self._http.call("DELETE", f"{self._base}/snapshots/{sid(snapshot)}", ok=(204,))

    async def rollback(self, snapshot: str) -> SandboxInfo:
        """Puts the filesystem back as it was at ``snapshot``; processes restart fresh."""
        return self._info(await self._http.json("POST", f"{self._base}/rollback", json={"snapshot": snapshot}))

    async def fork(self, snapshot: Optional[str] = None, count: int = 1) -> List["AsyncSandbox"]:
        """New sandboxes from a snapshot (by default one taken now), each with its own identity."""
        body: Dict[str, Any] = {"count": count}
        if snapshot:
            body["snapshot"] = snapshot
        r = await self._http.json("POST", f"{self._base}/fork", ok=(201,), json=body)
        return [AsyncSandbox(self._http, SandboxInfo.from_dict(s)) for s in r["sandboxes"]]

    async def diff(self, since: Optional[str] = None, until: Optional[str] = None) -> List[Change]:
        """Paths added, modified and deleted between two snapshots (``since`` absent: the
        sandbox's creation; ``until`` absent: the live filesystem)."""
        q = _core.params(**{"from": since, "to": until})
        return [Change.from_dict(c) for c in (await self._http.json("GET", f"{self._base}/diff", params=q))["changes"]]


class AsyncTemplates:
    def __init__(self, http: _Http):
        self._http = http

    async def list(self) -> List[Template]:
        return [Template.from_dict(t) for t in (await self._http.json("GET", "/v1/templates"))["templates"]]

    async def get(self, name: str) -> TemplateDetail:
        return TemplateDetail.from_dict(await self._http.json("GET", f"/v1/templates/{sid(name)}"))

    async def remove(self, name: str, version: Optional[int] = None) -> List[int]:
        """Removes one version, or all; refused (Conflict) while a sandbox uses one."""
        r = await self._http.json("DELETE", f"/v1/templates/{sid(name)}", params=_core.params(version=version))
        return list(r["versions"])

    async def _finish(self, lines: AsyncIterator[Dict[str, Any]], on_log: Optional[Callable[[TemplateLog], None]]) -> Template:
        async for line in lines:
            if line.get("type") == "error":
                err = line.get("error") or {}
                raise errors.SpaceError(None, err.get("code", ""), err.get("message", "failed"))
            log = TemplateLog.from_dict(line)
            if on_log:
                on_log(log)
            if log.type == "done" and log.template:
                return log.template
        raise errors.SpaceError(None, "stream_ended", "the progress stream ended without a result")

    async def pull(
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
        return await self._finish(self._http.lines("POST", f"/v1/templates/{sid(name)}/pull", json=body), on_log)

    async def build(
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
        return await self._finish(lines, on_log)

    async def set_start(self, name: str, start_cmd: Optional[str] = None, ready_cmd: Optional[str] = None, ready_timeout_secs: Optional[int] = None) -> Template:
        body = {k: v for k, v in [("start_cmd", start_cmd), ("ready_cmd", ready_cmd), ("ready_timeout_secs", ready_timeout_secs)] if v is not None}
        return Template.from_dict(await self._http.json("PUT", f"/v1/templates/{sid(name)}/start", json=body))

    async def from_snapshot(self, name: str, sandbox: str, snapshot: str) -> Template:
        """A template made of a sandbox's snapshot, with no copy."""
        body = {"sandbox": sandbox, "snapshot": snapshot}
        return Template.from_dict(await self._http.json("POST", f"/v1/templates/{sid(name)}/from-snapshot", ok=(200, 201), json=body))


class AsyncSecrets:
    def __init__(self, http: _Http):
        self._http = http

    async def set(self, name: str, value: str, hosts: Sequence[str], header: str) -> SecretInfo:
        """Creates or replaces a secret that sandboxes see only as a placeholder, which the
        egress proxy replaces in ``header`` (``"Authorization: Bearer {}"``) for ``hosts``."""
        body = {"value": value, "hosts": list(hosts), "header": header}
        return SecretInfo.from_dict(await self._http.json("PUT", f"/v1/secrets/{sid(name)}", json=body))

    async def get(self, name: str) -> SecretInfo:
        return SecretInfo.from_dict(await self._http.json("GET", f"/v1/secrets/{sid(name)}"))

    async def list(self) -> List[SecretInfo]:
        return [SecretInfo.from_dict(s) for s in (await self._http.json("GET", "/v1/secrets"))["secrets"]]

    async def delete(self, name: str) -> None:
        await self._http.call("DELETE", f"/v1/secrets/{sid(name)}", ok=(204,))


class AsyncPools:
    def __init__(self, http: _Http):
        self._http = http

    async def list(self) -> List[Pool]:
        return [Pool.from_dict(p) for p in (await self._http.json("GET", "/v1/pools"))["pools"]]

    async def get(self, template: str) -> Pool:
        return Pool.from_dict(await self._http.json("GET", f"/v1/templates/{sid(template)}/pool"))

    async def set(self, template: str, min: int, max: Optional[int] = None, runtime: Optional[str] = None) -> Pool:
        """Keeps ``min`` ready sandboxes of ``template`` (0 turns the pool off), growing toward
        ``max`` under load."""
        body: Dict[str, Any] = {"min": min}
        if max is not None:
            body["max"] = max
        if runtime:
            body["runtime"] = runtime
        return Pool.from_dict(await self._http.json("PUT", f"/v1/templates/{sid(template)}/pool", json=body))


class AsyncSpace:
    """A connection to spaced. ``url`` and ``api_key`` default to ``SPACE_URL`` and
    ``SPACE_API_KEY`` (then ``http://127.0.0.1:7070`` and the admin key file)."""

    def __init__(self, url: Optional[str] = None, api_key: Optional[str] = None, timeout: float = 60.0):
        self._http = _Http(url, api_key, timeout)
        self.templates = AsyncTemplates(self._http)
        self.secrets = AsyncSecrets(self._http)
        self.pools = AsyncPools(self._http)

    async def close(self) -> None:
        await self._http.client.aclose()

    async def __aenter__(self) -> "AsyncSpace":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def health(self) -> Dict[str, Any]:
        return dict(await self._http.json("GET", "/healthz"))

    async def e2b_settings(self) -> Dict[str, Any]:
        """``GET /v1/e2b``: the server's E2B domain (``--e2b-domain``) and the CA (PEM) of
        the certificates it issues for it; each None when there is none."""
        return dict(await self._http.json("GET", "/v1/e2b"))

    async def create(self, template: Optional[str] = None, *, secret_headers: Optional[Sequence[SecretHeader]] = None, **kw: Any) -> AsyncSandbox:
        """A new sandbox, running when this returns. Keywords: ``cpu``, ``memory_mib``,
        ``pids``, ``env``, ``metadata``, ``hostname``, ``timeout_secs``, ``on_timeout``,
        ``auto_pause_secs``, ``snapshot_policy``, ``egress``, ``allow``, ``secrets``,
        ``secret_headers`` and ``runtime``."""
        body = _core.create_body(template=template, secret_headers=secret_headers, **kw)
        info = SandboxInfo.from_dict(await self._http.json("POST", "/v1/sandboxes", ok=(201,), json=body))
        return AsyncSandbox(self._http, info)

    async def get(self, id: str) -> AsyncSandbox:
        return AsyncSandbox(self._http, SandboxInfo.from_dict(await self._http.json("GET", f"/v1/sandboxes/{sid(id)}")))

    async def list(self) -> List[AsyncSandbox]:
        r = await self._http.json("GET", "/v1/sandboxes")
        return [AsyncSandbox(self._http, SandboxInfo.from_dict(s)) for s in r["sandboxes"]]
