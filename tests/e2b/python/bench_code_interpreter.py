"""Benchmarks of the code interpreter (decision 0025) through the official SDK.

Run by `cargo test -p space-tests --test it e2b::bench_code_interpreter -- --ignored
--nocapture`, which builds the `code-interpreter` template first. Prints one JSON object:
p50/p90/p99 in ms over N runs.

- create_first_run_code: `Sandbox.create()` (a cold create: its ready command waits for the
  kernel) then `run_code("1")`; each sandbox is killed outside the timed part.
- pooled_create_first_run_code: the same with a warm pool of the template (min 2, set through
  the native API), waiting outside the timed part until the pool has a ready sandbox.
- run_code: `run_code("1 + 1")` on one sandbox, against `commands.run("true")` on the same.
"""

import json
import os
import time

from e2b_code_interpreter import Sandbox

from bench_sdk import native, summary

N = int(os.environ.get("BENCH_N", "40"))
N_CREATE = max(3, N // 8)


def creates(wait=None):
    """N_CREATE creates, each followed by its first run_code, in ms; `wait` runs untimed
    before each."""
    out = []
    for _ in range(N_CREATE):
        if wait:
            wait()
        t = time.perf_counter()
        sbx = Sandbox.create()
        sbx.run_code("1")
        out.append((time.perf_counter() - t) * 1000)
        sbx.kill()
    return out


def pool_ready():
    """Waits (at most 60 s) until the template's pool has a ready sandbox."""
    for _ in range(600):
        r = native.get("/v1/templates/code-interpreter/pool")
        r.raise_for_status()
        if r.json()["ready"] >= 1:
            return
        time.sleep(0.1)
    raise TimeoutError("the code-interpreter pool never got a ready sandbox")


def main():
    create = creates()
    r = native.put("/v1/templates/code-interpreter/pool", json={"min": 2, "max": 2})
    r.raise_for_status()
    pooled = creates(wait=pool_ready)
    native.put("/v1/templates/code-interpreter/pool", json={"min": 0}).raise_for_status()
    sbx = Sandbox.create()
    run_code, run = [], []
    try:
        for _ in range(3):
            sbx.run_code("1 + 1")
            sbx.commands.run("true")
        for _ in range(N):
            t = time.perf_counter()
            assert sbx.run_code("1 + 1").text == "2"
            run_code.append((time.perf_counter() - t) * 1000)
            t = time.perf_counter()
            sbx.commands.run("true")
            run.append((time.perf_counter() - t) * 1000)
    finally:
        sbx.kill()
    print(json.dumps({
        "create_first_run_code": summary(create),
        "pooled_create_first_run_code": summary(pooled),
        "run_code": summary(run_code),
        "commands_run_peer": summary(run),
    }, indent=1))


if __name__ == "__main__":
    main()
