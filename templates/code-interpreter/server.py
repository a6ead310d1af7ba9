"""space's code interpreter server (issue 13, decision 0025).

Serves, on 127.0.0.1:49999 inside the sandbox, the HTTP API that the official
`e2b-code-interpreter` SDK calls: `POST /execute` (an ndjson stream of stdout, stderr,
results, errors and the execution count), and `/contexts` to create, list, restart and remove
contexts. Each context is its own Jupyter kernel (ipykernel), driven with jupyter_client; no
Jupyter server runs. Only Python kernels are installed. Written for space; E2B's server is not
copied.
"""

import json
import os
import queue
import threading
import time
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from jupyter_client.manager import KernelManager

PORT = int(os.environ.get("SPACE_CI_PORT", "49999"))
HOME = os.path.expanduser("~")
MAX_BODY = 16 << 20
# Jupyter MIME types -> the SDK's Result fields.
MIME = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
}


class Context:
    """One kernel, one execution at a time."""

    def __init__(self, language, cwd, context_id=None):
        self.id = context_id or str(uuid.uuid4())
        self.language = language
        self.cwd = cwd
        self.lock = threading.Lock()
        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(cwd=cwd)
        self.kc = self.km.blocking_client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)

    def info(self):
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    def restart(self):
        with self.lock:
            self.kc.stop_channels()
            self.km.restart_kernel(now=True)
            self.kc = self.km.blocking_client()
            self.kc.start_channels()
            self.kc.wait_for_ready(timeout=60)

    def shutdown(self):
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)

    def _quiet(self, code):
        """Runs `code` silently and waits for the kernel to be idle again."""
        msg_id = self.kc.execute(code, silent=True, store_history=False)
        while True:
            msg = self.kc.get_iopub_msg(timeout=60)
            if (
                msg["parent_header"].get("msg_id") == msg_id
                and msg["msg_type"] == "status"
                and msg["content"]["execution_state"] == "idle"
            ):
                return

    def execute(self, code, env, emit):
        """Runs `code`, calling `emit` with each output line's object; returns at idle."""
        with self.lock:
            if env:
                self._quiet(
                    "import os as _space_os\n"
                    f"_space_env = {{k: _space_os.environ.get(k) for k in {list(env)!r}}}\n"
                    f"_space_os.environ.update({env!r})\n"
                )
            try:
                self._run(code, emit)
            finally:
                if env:
                    self._quiet(
                        "for _k, _v in _space_env.items():\n"
                        "    _space_os.environ.pop(_k, None) if _v is None "
                        "else _space_os.environ.__setitem__(_k, _v)\n"
                    )

    def _run(self, code, emit):
        msg_id = self.kc.execute(code, store_history=True, allow_stdin=False)
        while True:
            try:
                msg = self.kc.get_iopub_msg(timeout=1)
            except queue.Empty:
                if not self.km.is_alive():
                    emit(error("KernelDied", "the kernel died", ""))
                    return
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                emit({"type": content["name"], "text": content["text"], "timestamp": time.time_ns()})
            elif kind in ("execute_result", "display_data"):
                emit(result(content.get("data", {}), kind == "execute_result"))
            elif kind == "error":
                emit(error(content["ename"], content["evalue"], "\n".join(content["traceback"])))
            elif kind == "execute_input":
                emit({"type": "number_of_executions", "execution_count": content["execution_count"]})
            elif kind == "status" and content["execution_state"] == "idle":
                return

    def interrupt(self):
        self.km.interrupt_kernel()


def result(data, main):
    out = {"type": "result", "is_main_result": main}
    extra = {}
    for mime, value in data.items():
        field = MIME.get(mime)
        if field:
            out[field] = value
        else:
            extra[mime] = value
    if extra:
        out["extra"] = extra
    return out


def error(name, value, traceback):
    return {"type": "error", "name": name, "value": value, "traceback": traceback}


class Contexts:
    def __init__(self):
        self.lock = threading.Lock()
        self.by_id = {}
        self.default = self.add("python", HOME, context_id="default")

    def add(self, language, cwd, context_id=None):
        ctx = Context(language, cwd, context_id)
        with self.lock:
            self.by_id[ctx.id] = ctx
        return ctx

    def get(self, context_id):
        with self.lock:
            return self.by_id.get(context_id)

    def remove(self, context_id):
        with self.lock:
            ctx = self.by_id.pop(context_id, None)
        if ctx:
            ctx.shutdown()
        return ctx

    def all(self):
        with self.lock:
            return list(self.by_id.values())


CONTEXTS = None


def check_language(language):
    if language not in (None, "", "python", "python3"):
        raise HttpError(
            HTTPStatus.BAD_REQUEST,
            f"language {language!r} is not installed in this template: it runs Python kernels only",
        )


class HttpError(Exception):
    def __init__(self, status, message):
        super().__init__(message)
        self.status = status
        self.message = message


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "space-code-interpreter"

    def log_message(self, fmt, *args):
        pass

    def send_json(self, status, obj):
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def body(self):
        n = int(self.headers.get("Content-Length") or 0)
        if n > MAX_BODY:
            raise HttpError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"the body is over {MAX_BODY} bytes")
        raw = self.rfile.read(n) if n else b"{}"
        try:
            obj = json.loads(raw or b"{}")
        except ValueError as e:
            raise HttpError(HTTPStatus.BAD_REQUEST, f"the body is not JSON: {e}")
        if not isinstance(obj, dict):
            raise HttpError(HTTPStatus.BAD_REQUEST, "the body must be a JSON object")
        return obj

    def route(self, method):
        parts = [p for p in self.path.split("?")[0].split("/") if p]
        try:
            if method == "GET" and parts == ["health"]:
                return self.send_json(200, {"status": "ok"})
            if method == "POST" and parts == ["execute"]:
                return self.execute(self.body())
            if parts[:1] == ["contexts"]:
                return self.contexts(method, parts[1:])
            raise HttpError(HTTPStatus.NOT_FOUND, f"no {method} {self.path}")
        except HttpError as e:
            self.send_json(e.status, {"error": e.message})

    def contexts(self, method, rest):
        if method == "POST" and not rest:
            body = self.body()
            check_language(body.get("language"))
            cwd = body.get("cwd") or HOME
            if not os.path.isdir(cwd):
                raise HttpError(HTTPStatus.BAD_REQUEST, f"cwd {cwd!r} is not a directory")
            return self.send_json(200, CONTEXTS.add("python", cwd).info())
        if method == "GET" and not rest:
            return self.send_json(200, [c.info() for c in CONTEXTS.all()])
        ctx = CONTEXTS.get(rest[0]) if rest else None
        if ctx is None:
            raise HttpError(HTTPStatus.NOT_FOUND, f"context {rest[0] if rest else ''!r} not found")
        if method == "DELETE" and len(rest) == 1:
            CONTEXTS.remove(ctx.id)
            return self.send_json(200, {})
        if method == "POST" and rest[1:] == ["restart"]:
            ctx.restart()
            return self.send_json(200, {})
        raise HttpError(HTTPStatus.NOT_FOUND, f"no {method} {self.path}")

    def execute(self, body):
        code = body.get("code")
        if not isinstance(code, str):
            raise HttpError(HTTPStatus.BAD_REQUEST, "code must be a string")
        env = body.get("env_vars") or {}
        if not isinstance(env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()
        ):
            raise HttpError(HTTPStatus.BAD_REQUEST, "env_vars must map strings to strings")
        context_id = body.get("context_id")
        if context_id:
            ctx = CONTEXTS.get(context_id)
            if ctx is None:
                raise HttpError(HTTPStatus.NOT_FOUND, f"context {context_id!r} not found")
        else:
            check_language(body.get("language"))
            ctx = CONTEXTS.default
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        gone = []

        def emit(obj):
            if gone:
                return
            line = (json.dumps(obj) + "\n").encode()
            try:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                self.wfile.flush()
            except OSError:
                # The client left (its timeout): stop the code, as E2B does.
                gone.append(True)
                ctx.interrupt()

        ctx.execute(code, env, emit)
        emit({"type": "end_of_execution"})
        if not gone:
            try:
                self.wfile.write(b"0\r\n\r\n")
            except OSError:
                pass

    def do_GET(self):
        self.route("GET")

    def do_POST(self):
        self.route("POST")

    def do_DELETE(self):
        self.route("DELETE")


def main():
    global CONTEXTS
    CONTEXTS = Contexts()
    server = ThreadingHTTPServer(("127.0.0.1", PORT), Handler)
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main()
