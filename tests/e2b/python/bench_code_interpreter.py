"""Benchmarks of the code interpreter (decision 0025) through the official SDK.

Run by `cargo test -p space-tests --test it e2b::bench_code_interpreter -- --ignored
--nocapture`, which builds the `code-interpreter` template first. Prints one JSON object:
p50/p90/p99 in ms over N runs.

- create_first_run_code: `Sandbox.create()` (a cold create: its ready command waits for the
  kernel) then `run_code("1")`; each sandbox is killed outside the timed part.
- run_code: `run_code("1 + 1")` on one sandbox, against `commands.run("true")` on the same.
"""

import json
import os
import time

from e2b_code_interpreter import Sandbox

from bench_sdk import summary

N = int(os.environ.get("BENCH_N", "40"))
N_CREATE = max(3, N // 8)


def main():
    create = []
    for _ in range(N_CREATE):
        t = time.perf_counter()
        sbx = Sandbox.create()
        sbx.run_code("1")
        create.append((time.perf_counter() - t) * 1000)
        sbx.kill()
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
        "run_code": summary(run_code),
        "commands_run_peer": summary(run),
    }, indent=1))


if __name__ == "__main__":
    main()
