"""Benchmarks of the E2B facade (issue 13), with space's native API as the peer in the same run.

Run by `cargo test -p space-tests --test it e2b::bench_e2b_sdk -- --ignored --nocapture`,
which starts spaced and sets E2B_API_KEY, E2B_API_URL, E2B_SANDBOX_URL and SPACE_API_KEY.
Prints one JSON object: for each figure, p50/p90/p99 in ms (or MB/s) over N runs.

- create_first_run: `Sandbox.create()` then `commands.run("true")`, against POST
  /v1/sandboxes then POST /v1/sandboxes/{id}/exec of `true` (the native API over httpx);
  each sandbox is removed outside the timed part.
- create: the create call alone, both ways. `sdk_client_work` is the part of
  `Sandbox.create()` spent outside its HTTP request (the SDK building its per-sandbox API,
  envd and RPC clients), timed by wrapping the SDK's own request function: Python time no
  server can take away.
- create_wire: POST /v2/sandboxes and POST /v1/sandboxes from one httpx client: spaced's
  own share of the difference.
- run: `commands.run("true")` on one sandbox, against the native exec of `bash -l -c true`.
- stream: MB/s of `head -c 64000000 /dev/zero` through `commands.run`, against the native
  exec's ndjson stream of the same command.
- shell_floor: what a `commands.run` round trip cannot go under on this machine: one start
  of `/bin/bash -l -c true` inside the sandbox, by a bash loop there (no HTTP, spaced or
  daemon in it); N samples, each the mean of 20 starts. `run_over_floor` is run's p50 minus
  it: what the API path adds to the shell.
"""

import base64
import json
import os
import statistics
import sys
import time

import httpx
from e2b import Sandbox

URL = os.environ["E2B_API_URL"]
KEY = os.environ["SPACE_API_KEY"]
N = int(os.environ.get("BENCH_N", "40"))
native = httpx.Client(base_url=URL, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


def pct(samples, p):
    s = sorted(samples)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


def summary(samples, unit="ms"):
    return {
        "n": len(samples),
        "p50": round(pct(samples, 50), 3),
        "p90": round(pct(samples, 90), 3),
        "p99": round(pct(samples, 99), 3),
        "unit": unit,
    }


def native_exec(sid, cmd):
    """The native exec: returns the stdout bytes and the exit code."""
    out, code = bytearray(), None
    body = {"cmd": ["/bin/bash", "-l", "-c", cmd]}
    with native.stream("POST", f"/v1/sandboxes/{sid}/exec", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            ev = json.loads(line)
            if ev["type"] == "stdout":
                out += base64.b64decode(ev["data"])
            elif ev["type"] == "exit":
                code = ev.get("code")
    return bytes(out), code


def native_create():
    r = native.post("/v1/sandboxes", json={"timeout_secs": 600, "on_timeout": "delete"})
    r.raise_for_status()
    return r.json()["id"]


def bench_create_first_run():
    e2b, nat = [], []
    for _ in range(N):
        t = time.perf_counter()
        sbx = Sandbox.create(timeout=600)
        sbx.commands.run("true")
        e2b.append((time.perf_counter() - t) * 1000)
        sbx.kill()

        t = time.perf_counter()
        sid = native_create()
        _, code = native_exec(sid, "true")
        nat.append((time.perf_counter() - t) * 1000)
        assert code == 0
        native.delete(f"/v1/sandboxes/{sid}").raise_for_status()
        # Let the warm pool refill between rounds: both sides then measure a pool hit.
        time.sleep(0.3)
    return summary(e2b), summary(nat)


SDK_REQUEST = []
CLIENT_WORK = []


def _timed_sdk_request():
    """Wraps the SDK's create request so that its share of `Sandbox.create()` is known (a
    timer around the SDK's own function; the call itself is unchanged)."""
    from e2b.sandbox_sync.sandbox_api import SandboxApi

    descriptor = SandboxApi.__dict__["_create_sandbox"]
    call = SandboxApi._create_sandbox

    def timed(*a, **kw):
        t = time.perf_counter()
        try:
            return call(*a, **kw)
        finally:
            SDK_REQUEST.append((time.perf_counter() - t) * 1000)

    SandboxApi._create_sandbox = timed
    return descriptor


def bench_create():
    """The create call alone: `Sandbox.create()` against POST /v1/sandboxes."""
    from e2b.sandbox_sync.sandbox_api import SandboxApi

    e2b, nat, client_work = [], [], []
    real = _timed_sdk_request()
    try:
        for _ in range(N):
            t = time.perf_counter()
            sbx = Sandbox.create(timeout=600)
            e2b.append((time.perf_counter() - t) * 1000)
            client_work.append(e2b[-1] - SDK_REQUEST.pop())
            sbx.kill()
            t = time.perf_counter()
            sid = native_create()
            nat.append((time.perf_counter() - t) * 1000)
            native.delete(f"/v1/sandboxes/{sid}").raise_for_status()
            time.sleep(0.3)
    finally:
        SandboxApi._create_sandbox = real
    CLIENT_WORK.extend(client_work)
    return summary(e2b), summary(nat)


def bench_create_wire():
    """The server's share: POST /v2/sandboxes over the same httpx client as the native
    create, so that only what spaced does differs (the SDK's own client work is left out)."""
    e2b_key = os.environ["E2B_API_KEY"]
    e2b, nat = [], []
    for _ in range(N):
        t = time.perf_counter()
        r = native.post("/v2/sandboxes", headers={"X-API-KEY": e2b_key},
                        json={"templateID": "base", "timeout": 600})
        e2b.append((time.perf_counter() - t) * 1000)
        assert r.status_code == 201, r.text
        native.delete(f"/v1/sandboxes/{r.json()['sandboxID']}").raise_for_status()
        t = time.perf_counter()
        sid = native_create()
        nat.append((time.perf_counter() - t) * 1000)
        native.delete(f"/v1/sandboxes/{sid}").raise_for_status()
        time.sleep(0.3)
    return summary(e2b), summary(nat)


def bench_run():
    sbx = Sandbox.create(timeout=600)
    e2b, nat = [], []
    try:
        for _ in range(5):
            sbx.commands.run("true")
            native_exec(sbx.sandbox_id, "true")
        for _ in range(N * 5):
            t = time.perf_counter()
            sbx.commands.run("true")
            e2b.append((time.perf_counter() - t) * 1000)
            t = time.perf_counter()
            native_exec(sbx.sandbox_id, "true")
            nat.append((time.perf_counter() - t) * 1000)
    finally:
        sbx.kill()
    return summary(e2b), summary(nat)


def bench_stream():
    size = 64_000_000
    cmd = f"head -c {size} /dev/zero"
    sbx = Sandbox.create(timeout=600)
    e2b, nat = [], []
    try:
        for _ in range(5):
            t = time.perf_counter()
            r = sbx.commands.run(cmd, timeout=0)
            e2b.append(size / 1e6 / (time.perf_counter() - t))
            assert len(r.stdout) == size, len(r.stdout)
            t = time.perf_counter()
            out, _ = native_exec(sbx.sandbox_id, cmd)
            nat.append(size / 1e6 / (time.perf_counter() - t))
            assert len(out) == size, len(out)
    finally:
        sbx.kill()
    return summary(e2b, "MB/s"), summary(nat, "MB/s")


def bench_shell_floor():
    sbx = Sandbox.create(timeout=600)
    loop = (
        "for k in $(seq %d); do s=$(date +%%s%%N); for i in $(seq 20); do /bin/bash -l -c true;"
        " done; e=$(date +%%s%%N); echo $(( (e - s) / 20000 )); done" % N
    )
    try:
        r = sbx.commands.run(loop, timeout=0)
    finally:
        sbx.kill()
    return summary([int(us) / 1000 for us in r.stdout.split()])


def main():
    result = {}
    for name, fn in [
        ("create_first_run", bench_create_first_run),
        ("create", bench_create),
        ("create_wire", bench_create_wire),
        ("run", bench_run),
        ("stream", bench_stream),
    ]:
        e2b, nat = fn()
        ratio = round(e2b["p50"] / nat["p50"], 2) if nat["p50"] else None
        result[name] = {"e2b_sdk": e2b, "native": nat, "p50_ratio": ratio,
                        "p50_diff": round(e2b["p50"] - nat["p50"], 3)}
        print(name, json.dumps(result[name]), file=sys.stderr, flush=True)
    floor = bench_shell_floor()
    result["shell_floor"] = floor
    result["run_over_floor"] = {
        "e2b_sdk": round(result["run"]["e2b_sdk"]["p50"] - floor["p50"], 3),
        "native": round(result["run"]["native"]["p50"] - floor["p50"], 3),
    }
    result["sdk_client_work"] = summary(CLIENT_WORK)
    print("shell_floor", json.dumps(floor), file=sys.stderr, flush=True)
    print("sdk_client_work", json.dumps(result["sdk_client_work"]), file=sys.stderr, flush=True)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
