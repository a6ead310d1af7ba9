"""The official `e2b` Python SDK against a real spaced (issue 13, decision 0022).

Run by the Rust integration test `e2b::the_official_python_sdk_runs_against_space`, which starts
spaced in its own network namespace and sets E2B_API_KEY (`space e2b env`'s form),
E2B_API_URL and E2B_SANDBOX_URL. Nothing here imitates the SDK: every call is the SDK's own.
"""

import json
import os
import time
import unittest

import httpx
from e2b import (
    AuthenticationException,
    CommandExitException,
    NotFoundException,
    PtySize,
    Sandbox,
    SandboxException,
    SandboxQuery,
    SandboxState,
    TimeoutException,
)

URL = os.environ["E2B_API_URL"]
NATIVE = {"Authorization": f"Bearer {os.environ['SPACE_API_KEY']}"}


def port_request(sbx, port, path="/", token=None, method="GET", **kw):
    """A request for `port` of the sandbox through E2B's address, as E2B's proxy takes them:
    `E2b-Sandbox-Id`, `E2b-Sandbox-Port`, and the traffic token (the sandbox's own unless
    `token` names another; "" sends none)."""
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": str(port)}
    token = sbx.traffic_access_token if token is None else token
    if token:
        headers["E2B-Traffic-Access-Token"] = token
    return httpx.request(method, f"{URL}{path}", headers=headers, **kw)


def native(sbx):
    """The sandbox as space's own API shows it."""
    r = httpx.get(f"{URL}/v1/sandboxes/{sbx.sandbox_id}", headers=NATIVE)
    r.raise_for_status()
    return r.json()


class Commands(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.sbx = Sandbox.create(envs={"GREETING": "hello"}, metadata={"suite": "commands"})

    @classmethod
    def tearDownClass(cls):
        cls.sbx.kill()

    def test_run_returns_output_and_exit_code(self):
        r = self.sbx.commands.run("echo hi; echo err >&2")
        self.assertEqual((r.stdout, r.stderr, r.exit_code), ("hi\n", "err\n", 0))

    def test_defaults_are_the_ones_e2b_code_expects(self):
        r = self.sbx.commands.run('whoami; pwd; echo "$GREETING $HOME"; echo $0')
        self.assertEqual(r.stdout, "user\n/home/user\nhello /home/user\n/bin/bash\n")
        r = self.sbx.commands.run("whoami", user="root")
        self.assertEqual(r.stdout, "root\n")
        r = self.sbx.commands.run("echo $X; pwd", envs={"X": "42"}, cwd="/tmp")
        self.assertEqual(r.stdout, "42\n/tmp\n")

    def test_a_failing_command_raises_command_exit_exception(self):
        with self.assertRaises(CommandExitException) as cm:
            self.sbx.commands.run("echo out; exit 3")
        self.assertEqual(cm.exception.exit_code, 3)
        self.assertEqual(cm.exception.stdout, "out\n")

    def test_background_command_and_reconnect_after_the_client_dropped(self):
        h = self.sbx.commands.run(
            "for i in 1 2 3; do echo line$i; sleep 0.3; done", background=True
        )
        pid = h.pid
        h.disconnect()
        self.assertIn(pid, [p.pid for p in self.sbx.commands.list()])
        # A second client (a new Sandbox object, as after an agent restart) reconnects.
        other = Sandbox.connect(self.sbx.sandbox_id)
        r = other.commands.connect(pid).wait()
        self.assertEqual(r.stdout, "line1\nline2\nline3\n")
        self.assertEqual(r.exit_code, 0)

    def test_stdin_send_and_close(self):
        h = self.sbx.commands.run("cat", background=True, stdin=True)
        self.sbx.commands.send_stdin(h.pid, "hello\n")
        self.sbx.commands.close_stdin(h.pid)
        self.assertEqual(h.wait().stdout, "hello\n")

    def test_kill_and_list(self):
        h = self.sbx.commands.run("sleep 300", background=True)
        self.assertIn("sleep 300", [" ".join(p.args) for p in self.sbx.commands.list()][-1])
        self.assertTrue(self.sbx.commands.kill(h.pid))
        with self.assertRaises(CommandExitException) as cm:
            h.wait()
        self.assertEqual(cm.exception.exit_code, -1)
        self.assertNotIn(h.pid, [p.pid for p in self.sbx.commands.list()])
        self.assertFalse(self.sbx.commands.kill(999999))

    def test_a_command_timeout_ends_the_stream_not_the_process(self):
        with self.assertRaises(TimeoutException):
            self.sbx.commands.run("sleep 3; echo late > /tmp/late", timeout=1)
        time.sleep(3)
        self.assertEqual(self.sbx.commands.run("cat /tmp/late").stdout, "late\n")

    def test_no_timeout_runs_past_the_default(self):
        r = self.sbx.commands.run("sleep 2; echo ok", timeout=0)
        self.assertEqual(r.stdout, "ok\n")

    def test_a_pty_session_with_resize_and_streamed_input(self):
        h = self.sbx.pty.create(PtySize(rows=24, cols=80))
        self.sbx.pty.resize(h.pid, PtySize(rows=30, cols=100))
        self.sbx.pty.send_stdin(h.pid, b"stty size; echo marker-$((6*7)); tty\n")
        if hasattr(self.sbx.pty, "stream_input"):  # SDKs since 2.5x
            self.sbx.pty.stream_input(h.pid, [b"exit ", b"5\n"])
        else:
            self.sbx.pty.send_stdin(h.pid, b"exit 5\n")
        out = bytearray()
        with self.assertRaises(CommandExitException) as cm:
            h.wait(on_pty=out.extend)
        self.assertEqual(cm.exception.exit_code, 5)
        self.assertIn(b"30 100", out)
        self.assertIn(b"marker-42", out)
        self.assertIn(b"/dev/pts/", out)

    def test_large_output_arrives_whole(self):
        r = self.sbx.commands.run("head -c 3000000 /dev/zero | tr '\\0' a")
        self.assertEqual(len(r.stdout), 3_000_000)


class Lifecycle(unittest.TestCase):
    def test_info_list_connect_timeout_and_kill(self):
        a = Sandbox.create(metadata={"suite": "lifecycle", "n": "a"}, timeout=120)
        b = Sandbox.create(metadata={"suite": "lifecycle", "n": "b"})
        try:
            info = a.get_info()
            self.assertEqual(info.sandbox_id, a.sandbox_id)
            self.assertEqual(info.template_id, "base")
            self.assertEqual(info.metadata, {"suite": "lifecycle", "n": "a"})
            self.assertEqual(info.state, SandboxState.RUNNING)
            end = info.end_at

            # A connect never shortens the deadline ...
            Sandbox.connect(a.sandbox_id, timeout=10)
            self.assertEqual(a.get_info().end_at, end)
            # ... and set_timeout sets it, as on E2B.
            a.set_timeout(30)
            self.assertLess(a.get_info().end_at, end)

            found = Sandbox.list(query=SandboxQuery(metadata={"suite": "lifecycle"})).next_items()
            self.assertEqual({s.sandbox_id for s in found}, {a.sandbox_id, b.sandbox_id})
            only_b = Sandbox.list(query=SandboxQuery(metadata={"n": "b"})).next_items()
            self.assertEqual([s.sandbox_id for s in only_b], [b.sandbox_id])

            # Pages of one, newest first, until has_next is false.
            pages = Sandbox.list(query=SandboxQuery(metadata={"suite": "lifecycle"}), limit=1)
            seen = []
            while pages.has_next:
                seen += [s.sandbox_id for s in pages.next_items()]
            self.assertEqual(seen, [b.sandbox_id, a.sandbox_id])
        finally:
            self.assertTrue(a.kill())
            self.assertTrue(b.kill())
        self.assertFalse(a.is_running())
        self.assertFalse(Sandbox.kill(a.sandbox_id))
        with self.assertRaises(NotFoundException):
            Sandbox.connect(a.sandbox_id)
        with self.assertRaises(NotFoundException):
            Sandbox.get_info(a.sandbox_id)
        with self.assertRaises(Exception):
            a.commands.run("true")

    def test_network_settings_become_the_egress_policy(self):
        sbx = Sandbox.create(network={"allow_out": ["pypi.org"], "deny_out": ["0.0.0.0/0"]})
        try:
            net = native(sbx)["network"]
            self.assertEqual((net["egress"], net["allow"]), ("allowlist", ["pypi.org"]))
            sbx.update_network({"allow_internet_access": False})
            self.assertEqual(native(sbx)["network"]["egress"], "none")
            sbx.update_network({"allow_out": ["10.1.0.0/16"], "deny_out": ["0.0.0.0/0"]})
            net = native(sbx)["network"]
            # E2B admits addresses on every port: space writes that as ":*".
            self.assertEqual((net["egress"], net["allow"]), ("allowlist", ["10.1.0.0/16:*"]))
            # space has no deny rules: a particular denyOut is refused, and nothing changes.
            with self.assertRaises(SandboxException) as cm:
                sbx.update_network({"deny_out": ["1.2.3.4"]})
            self.assertIn("cannot deny particular destinations", str(cm.exception))
            self.assertEqual(native(sbx)["network"]["allow"], ["10.1.0.0/16:*"])
        finally:
            sbx.kill()
        off = Sandbox.create(allow_internet_access=False)
        try:
            self.assertEqual(native(off)["network"]["egress"], "none")
        finally:
            off.kill()

    def test_fork_copies_the_filesystem_into_independent_sandboxes(self):
        sbx = Sandbox.create(metadata={"role": "parent"})
        forks = []
        try:
            sbx.files.write("/home/user/state.txt", "before fork")
            forks = sbx.fork(count=2, timeout=120)
            self.assertEqual(len(forks), 2)
            for f in forks:
                self.assertIsInstance(f, Sandbox)
                self.assertNotEqual(f.sandbox_id, sbx.sandbox_id)
                self.assertEqual(f.files.read("/home/user/state.txt"), "before fork")
                f.files.write("/home/user/state.txt", "changed in " + f.sandbox_id)
            self.assertEqual(sbx.files.read("/home/user/state.txt"), "before fork")
            self.assertNotEqual(forks[0].files.read("/home/user/state.txt"),
                                forks[1].files.read("/home/user/state.txt"))
        finally:
            for f in forks:
                if isinstance(f, Sandbox):
                    f.kill()
            sbx.kill()

    def test_snapshots_are_templates_new_sandboxes_start_from(self):
        sbx = Sandbox.create()
        made = []
        try:
            sbx.files.write("/home/user/snap.txt", "in the snapshot")
            info = sbx.create_snapshot(name="e2b-snap-test")
            self.assertEqual(info.snapshot_id, "e2b-snap-test")
            auto = sbx.create_snapshot()
            self.assertTrue(auto.snapshot_id.startswith("snapshot-"))
            sbx.files.write("/home/user/snap.txt", "changed after")
            ids = []
            pages = Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id, limit=1)
            while pages.has_next:
                ids += [s.snapshot_id for s in pages.next_items()]
            self.assertEqual(sorted(ids), sorted(["e2b-snap-test", auto.snapshot_id]))
            child = Sandbox.create(template="e2b-snap-test")
            made.append(child)
            self.assertEqual(child.files.read("/home/user/snap.txt"), "in the snapshot")
            # A snapshot a sandbox still runs from is kept (space's rule for templates).
            with self.assertRaises(SandboxException) as cm:
                Sandbox.delete_snapshot("e2b-snap-test")
            self.assertIn("used by 1 sandbox", str(cm.exception))
            child.kill()
            made.clear()
            self.assertTrue(Sandbox.delete_snapshot("e2b-snap-test"))
            self.assertFalse(Sandbox.delete_snapshot("e2b-snap-test"))
            self.assertTrue(Sandbox.delete_snapshot(auto.snapshot_id))
            # The Debian base is a template, not a snapshot: it is never removed this way.
            with self.assertRaises(SandboxException):
                Sandbox.delete_snapshot("base")
        finally:
            for c in made:
                c.kill()
            sbx.kill()

    def test_metrics_show_cpu_memory_and_disk(self):
        sbx = Sandbox.create()
        try:
            sbx.commands.run("timeout 1.5 sh -c 'while :; do :; done'; head -c 8M /dev/zero > /tmp/z")
            metrics = sbx.get_metrics()
            self.assertGreaterEqual(len(metrics), 1)
            last = metrics[-1]
            self.assertGreaterEqual(last.cpu_count, 1)
            self.assertEqual(last.mem_total, native(sbx)["memory_mib"] << 20)
            self.assertGreater(last.mem_used, 0)
            self.assertGreater(last.disk_total, last.disk_used)
            self.assertGreater(last.disk_used, 0)
            self.assertTrue(all(0 <= m.cpu_used_pct <= 100 for m in metrics))
            self.assertGreater(max(m.cpu_used_pct for m in metrics), 0)
            times = [m.timestamp for m in metrics]
            self.assertEqual(times, sorted(times))
            self.assertEqual(Sandbox.get_metrics(sbx.sandbox_id)[-1].mem_total, last.mem_total)
        finally:
            sbx.kill()
        with self.assertRaises(NotFoundException):
            Sandbox.get_metrics(sbx.sandbox_id)

    def test_pause_and_resume_through_connect_keep_processes_and_files(self):
        sbx = Sandbox.create()
        try:
            sbx.commands.run("echo kept > /home/user/f")
            h = sbx.commands.run("sleep 300", background=True)
            sbx.pause()
            self.assertEqual(sbx.get_info().state, SandboxState.PAUSED)
            self.assertFalse(sbx.is_running())
            back = Sandbox.connect(sbx.sandbox_id)
            self.assertEqual(back.get_info().state, SandboxState.RUNNING)
            self.assertEqual(back.commands.run("cat /home/user/f").stdout, "kept\n")
            self.assertIn(h.pid, [p.pid for p in back.commands.list()])
        finally:
            sbx.kill()

    def test_a_filesystem_only_pause_keeps_files_and_resumes_cold(self):
        # keep_memory=False is what both SDK versions send as {"memory": false}
        # (the newest also takes mode="filesystem").
        sbx = Sandbox.create()
        try:
            sbx.commands.run("echo kept > /home/user/f")
            h = sbx.commands.run("sleep 300", background=True)
            sbx.pause(keep_memory=False)
            self.assertEqual(sbx.get_info().state, SandboxState.PAUSED)
            self.assertEqual(native(sbx)["state"], "stopped")
            self.assertFalse(sbx.is_running())
            back = Sandbox.connect(sbx.sandbox_id)
            self.assertEqual(back.get_info().state, SandboxState.RUNNING)
            self.assertEqual(back.commands.run("cat /home/user/f").stdout, "kept\n")
            self.assertNotIn(h.pid, [p.pid for p in back.commands.list()])
            self.assertEqual(back.commands.run("pgrep -x sleep || true").stdout, "")
        finally:
            sbx.kill()


    def test_a_timeout_can_pause_filesystem_only(self):
        # autoPause with autoPauseMemory false: keep_memory=False in the lifecycle's object form
        # (both SDK versions; the newest also takes mode="filesystem").
        sbx = Sandbox.create(timeout=2, lifecycle={"on_timeout": {"action": "pause", "keep_memory": False}})
        try:
            sbx.commands.run("echo kept > /home/user/f")
            deadline = time.time() + 30
            while native(sbx)["state"] != "stopped" and time.time() < deadline:
                time.sleep(0.2)
            self.assertEqual(native(sbx)["state"], "stopped")
            self.assertEqual(sbx.get_info().state, SandboxState.PAUSED)
            back = Sandbox.connect(sbx.sandbox_id)
            self.assertEqual(back.commands.run("cat /home/user/f").stdout, "kept\n")
        finally:
            sbx.kill()


class BadInput(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.sbx = Sandbox.create()

    @classmethod
    def tearDownClass(cls):
        cls.sbx.kill()

    def envd(self, method, token=None, body=b"", content_type="application/connect+json"):
        headers = {
            "E2b-Sandbox-Id": self.sbx.sandbox_id,
            "E2b-Sandbox-Port": "49983",
            "Content-Type": content_type,
        }
        if token is not None:
            headers["X-Access-Token"] = token
        return httpx.post(f"{URL}/process.Process/{method}", headers=headers, content=body)

    def test_a_wrong_key_is_an_authentication_error(self):
        with self.assertRaises(AuthenticationException):
            Sandbox.create(api_key="e2b_" + "00" * 21)

    def test_an_unknown_template_is_refused(self):
        with self.assertRaises(Exception) as cm:
            Sandbox.create(template="no-such-template")
        self.assertIn("no-such-template", str(cm.exception))

    def test_an_unknown_sandbox_is_not_found(self):
        with self.assertRaises(NotFoundException):
            Sandbox.connect("a" * 20)

    def test_envd_wants_the_sandboxs_access_token(self):
        self.assertEqual(self.envd("List", content_type="application/json").status_code, 401)
        r = self.envd("List", token="0" * 64, content_type="application/json")
        self.assertEqual(r.status_code, 401)
        # Another sandbox's token does not open this one.
        other = Sandbox.create()
        try:
            r = self.envd("List", token=other._envd_access_token, content_type="application/json")
            self.assertEqual(r.status_code, 401)
            # Nor does another sandbox's traffic token open this one's ports.
            r = port_request(self.sbx, 8080, token=other.traffic_access_token)
            self.assertEqual(r.status_code, 401)
        finally:
            other.kill()
        # The traffic token opens ports, never envd.
        r = self.envd("List", token=self.sbx.traffic_access_token, content_type="application/json")
        self.assertEqual(r.status_code, 401)

    def test_a_port_nothing_listens_on_is_a_502(self):
        self.assertEqual(port_request(self.sbx, 8080).status_code, 502)
        # A server started in the sandbox answers through the same address.
        self.sbx.commands.run("mkdir -p /tmp/www && echo served > /tmp/www/i.txt")
        self.sbx.commands.run("cd /tmp/www && python3 -m http.server 8080 --bind 127.0.0.1", background=True)
        for _ in range(100):
            r = port_request(self.sbx, 8080, "/i.txt")
            if r.status_code == 200:
                break
            time.sleep(0.1)
        self.assertEqual((r.status_code, r.text), (200, "served\n"))

    def test_a_malformed_envelope_is_invalid_argument_and_disturbs_nothing(self):
        token = self.sbx._envd_access_token
        r = self.envd("Start", token=token, body=b"\x00\x00\x00\x00\x09{}")
        self.assertEqual(r.status_code, 200)
        end = json.loads(r.content[5:])
        self.assertEqual(end["error"]["code"], "invalid_argument")
        self.assertEqual(self.sbx.commands.run("echo still").stdout, "still\n")

    def test_an_unknown_pid_is_not_found(self):
        with self.assertRaises(NotFoundException):
            self.sbx.commands.connect(999999).wait()
        with self.assertRaises(NotFoundException):
            self.sbx.commands.send_stdin(999999, "x")


if __name__ == "__main__":
    unittest.main()
