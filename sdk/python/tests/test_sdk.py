"""space-sdk against a real spaced.

Run by the Rust integration test `sdk::the_python_sdk_drives_a_real_spaced`, which starts
spaced (Debian `base` as the default template) and sets SPACE_URL and SPACE_API_KEY.
"""

import asyncio
import time
import unittest

from space_sdk import (
    AsyncSpace,
    Conflict,
    ExecError,
    InvalidArgument,
    NotFound,
    SecretHeader,
    Space,
    Unauthorized,
)


class Sandboxes(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.space = Space()
        cls.sbx = cls.space.create(env={"GREETING": "hi"}, metadata={"suite": "sdk"})

    @classmethod
    def tearDownClass(cls):
        cls.sbx.kill()
        cls.space.close()

    def test_create_get_and_list(self):
        info = self.sbx.info
        self.assertEqual((info.state, info.template, info.metadata), ("running", "base", {"suite": "sdk"}))
        self.assertEqual(self.space.get(self.sbx.id).info.id, self.sbx.id)
        self.assertIn(self.sbx.id, [s.id for s in self.space.list()])
        self.assertEqual(self.space.health()["status"], "ok")
        self.assertEqual(self.space.e2b_settings(), {"domain": None, "ca": None})

    def test_run_returns_output_and_exit_codes(self):
        r = self.sbx.run("echo $GREETING; echo err >&2; exit 3")
        self.assertEqual((r.stdout, r.stderr, r.exit_code, r.ok), ("hi\n", "err\n", 3, False))
        with self.assertRaises(ExecError) as cm:
            self.sbx.run(["false"], check=True)
        self.assertEqual(cm.exception.result.exit_code, 1)
        self.assertEqual(self.sbx.run(["cat"], stdin="piped").stdout, "piped")
        r = self.sbx.run("pwd; id -un", cwd="/tmp", user="root")
        self.assertEqual(r.stdout, "/tmp\nroot\n")
        seen = []
        self.sbx.run("printf a; printf b", on_stdout=seen.append)
        self.assertEqual(b"".join(seen), b"ab")

    def test_a_stream_carries_offsets_and_ends_with_the_exit(self):
        events = list(self.sbx.exec_stream("printf 12345; printf 678"))
        self.assertEqual(events[0].type, "started")
        out = [e for e in events if e.type == "stdout"]
        self.assertEqual(b"".join(e.data for e in out), b"12345678")
        self.assertEqual(out[0].offset, 0)
        self.assertEqual((events[-1].type, events[-1].code), ("exit", 0))

    def test_background_processes_reconnect_from_an_offset(self):
        pid = self.sbx.start("for i in 1 2 3; do echo line$i; done; sleep 0.2", tag="bg")
        full = self.sbx.wait(pid)
        self.assertEqual((full.stdout, full.exit_code), ("line1\nline2\nline3\n", 0))
        # A reconnect from byte 6 gets exactly what comes after it.
        rest = b"".join(e.data for e in self.sbx.output(pid, offset=6) if e.type == "stdout")
        self.assertEqual(rest, b"line2\nline3\n")
        self.assertIn(pid, [p.pid for p in self.sbx.processes() if p.tag == "bg"])

    def test_stdin_and_signals(self):
        pid = self.sbx.start(["cat"], keep_stdin=True)
        self.sbx.write_stdin(pid, "to cat\n")
        self.sbx.close_stdin(pid)
        self.assertEqual(self.sbx.wait(pid).stdout, "to cat\n")
        pid = self.sbx.start(["sleep", "60"])
        self.sbx.signal(pid, "KILL")
        self.assertEqual(self.sbx.wait(pid).signal, 9)
        with self.assertRaises(NotFound):
            self.sbx.signal(999999, "TERM")

    def test_files(self):
        f = self.sbx.files
        e = f.write("/home/user/d/a.txt", "hello", parents=True, mode=0o600)
        self.assertEqual((e.name, e.size, e.mode, e.owner), ("a.txt", 5, 0o600, "user"))
        self.assertEqual(f.read_text("/home/user/d/a.txt"), "hello")
        big = bytes(range(256)) * 8192
        f.write("/home/user/d/big", iter([big[:1000], big[1000:]]))
        self.assertEqual(b"".join(f.iter_read("/home/user/d/big", 65536)), big)
        self.assertEqual(f.stat("/home/user/d/big").size, len(big))
        self.assertEqual(sorted(x.name for x in f.list("/home/user/d")), ["a.txt", "big"])
        f.mkdir("/home/user/d/sub/deeper", parents=True)
        f.rename("/home/user/d/a.txt", "/home/user/d/sub/b.txt")
        self.assertTrue(f.exists("/home/user/d/sub/b.txt"))
        self.assertFalse(f.exists("/home/user/d/a.txt"))
        f.remove("/home/user/d", recursive=True)
        with self.assertRaises(NotFound):
            f.read("/home/user/d/big")
        with self.assertRaises(InvalidArgument):
            f.stat("relative/path")

    def test_watch_sees_changes(self):
        self.sbx.files.mkdir("/home/user/w")
        events = self.sbx.files.watch("/home/user/w")
        self.assertEqual(next(events).type, "started")
        self.sbx.files.write("/home/user/w/x", "1")
        seen = []
        for e in events:
            seen.append((e.type, e.name))
            if ("create", "x") in seen or len(seen) > 10:
                break
        events.close()
        self.assertIn(("create", "x"), seen)

    def test_lifecycle_network_ports_events_and_metrics(self):
        with self.space.create(timeout_secs=600) as sbx:
            self.assertIsNotNone(sbx.info.timeout_at)
            sbx.pause()
            self.assertEqual(sbx.refresh().state, "paused")
            with self.assertRaises(Conflict):
                sbx.run("true")
            sbx.resume()
            self.assertEqual(sbx.run("echo back").stdout, "back\n")
            # A filesystem-only pause: processes end, files stay, resume starts it cold.
            sbx.run("echo kept > /home/user/f")  # not /tmp: a tmpfs, emptied as by a reboot
            pid = sbx.start(["sleep", "300"])
            self.assertEqual(sbx.pause(memory=False).state, "stopped")
            with self.assertRaises(Conflict):
                sbx.run("true")
            self.assertEqual(sbx.resume().state, "running")
            self.assertEqual(sbx.files.read_text("/home/user/f"), "kept\n")
            self.assertNotIn(pid, [p.pid for p in sbx.processes() if p.running])
            self.assertIsNone(sbx.set_timeout(None).timeout_at)
            n = sbx.set_network(egress="allowlist", allow=["pypi.org"]).network
            self.assertEqual((n.egress, n.allow), ("allowlist", ["pypi.org"]))
            with self.assertRaises(InvalidArgument):
                sbx.set_network(egress="allowlist", allow=["not a rule!"])
            self.assertIn("/p/", sbx.port_url(8080))
            actions = [e.action for e in sbx.events()]
            self.assertIn("create", actions)
            self.assertIn("pause", actions)
            self.assertGreater(sbx.metrics().memory_limit_bytes, 0)
        with self.assertRaises(NotFound):
            self.space.get(sbx.id)


class Snapshots(unittest.TestCase):
    def test_snapshot_diff_rollback_and_fork(self):
        with Space() as space, space.create() as sbx:
            sbx.files.write("/home/user/keep.txt", "v1")
            snap = sbx.snapshot(label="v1")
            self.assertEqual((snap.label, snap.kind), ("v1", "disk"))
            sbx.files.write("/home/user/keep.txt", "v2")
            sbx.files.write("/home/user/new.txt", "n")
            changes = {(c.path, c.change) for c in sbx.diff(since=snap.id)}
            self.assertIn(("/home/user/keep.txt", "modified"), changes)
            self.assertIn(("/home/user/new.txt", "added"), changes)
            sbx.rollback(snap.id)
            self.assertEqual(sbx.files.read_text("/home/user/keep.txt"), "v1")
            self.assertFalse(sbx.files.exists("/home/user/new.txt"))
            self.assertIn(snap.id, [s.id for s in sbx.snapshots()])
            forks = sbx.fork(snapshot=snap.id, count=2)
            try:
                self.assertEqual(len({f.id for f in forks}), 2)
                for f in forks:
                    self.assertEqual(f.files.read_text("/home/user/keep.txt"), "v1")
            finally:
                for f in forks:
                    f.kill()
            with self.assertRaises(NotFound):
                sbx.rollback("a" * 20)


class Platform(unittest.TestCase):
    def test_secrets_templates_and_pools(self):
        with Space() as space:
            info = space.secrets.set("SDK_TOKEN", "s3cret", ["api.example.test"], "Authorization: Bearer {}")
            self.assertEqual((info.name, info.hosts, info.version), ("SDK_TOKEN", ["api.example.test"], 1))
            self.assertEqual(space.secrets.set("SDK_TOKEN", "again", ["api.example.test"], "X: {}").version, 2)
            self.assertNotIn("s3cret", repr(space.secrets.list()))
            with space.create(
                secrets=["SDK_TOKEN"],
                secret_headers=[SecretHeader("SDK_TOKEN", ["api.example.test"], "X-Key: {}")],
            ) as sbx:
                env = sbx.run("echo $SDK_TOKEN").stdout
                self.assertTrue(env.startswith("spc_ph_"), env)
                self.assertEqual(sbx.info.secrets, ["SDK_TOKEN"])
            with self.assertRaises(InvalidArgument):
                space.create(secret_headers=[SecretHeader("NO_SUCH", ["a.example.test"], "X: {}")])
            space.secrets.delete("SDK_TOKEN")
            with self.assertRaises(NotFound):
                space.secrets.get("SDK_TOKEN")

            names = {t.name for t in space.templates.list()}
            self.assertIn("base", names)
            self.assertTrue(space.templates.get("base").versions)
            with self.assertRaises(NotFound):
                space.templates.get("no-such-template")
            pool = space.pools.set("minimal", min=1, max=2)
            self.assertEqual((pool.template, pool.min, pool.max), ("minimal", 1, 2))
            self.assertIn("minimal", [p.template for p in space.pools.list()])
            space.pools.set("minimal", min=0)

    def test_errors_name_what_is_wrong(self):
        with Space() as space:
            with self.assertRaises(NotFound):
                space.get("a" * 20)
            with self.assertRaises(InvalidArgument) as cm:
                space.create(memory_mib=1)
            self.assertIn("memory", cm.exception.message)
            with self.assertRaises(NotFound):
                space.create(template="no-such-template")
        with Space(api_key="sk_wrong") as wrong:
            with self.assertRaises(Unauthorized):
                wrong.list()


class Async(unittest.TestCase):
    def test_the_async_client_runs_the_same_calls(self):
        async def main():
            async with AsyncSpace() as space:
                async with await space.create() as sbx:
                    r = await sbx.run("echo async")
                    self.assertEqual(r.stdout, "async\n")
                    await sbx.files.write("/home/user/a", b"x")
                    self.assertEqual(await sbx.files.read("/home/user/a"), b"x")
                    pid = await sbx.start("echo bg")
                    self.assertEqual((await sbx.wait(pid)).stdout, "bg\n")
                    events = [e.type async for e in sbx.exec_stream(["true"])]
                    self.assertEqual((events[0], events[-1]), ("started", "exit"))
                    snap = await sbx.snapshot()
                    await sbx.files.remove("/home/user/a")
                    await sbx.rollback(snap.id)
                    self.assertTrue(await sbx.files.exists("/home/user/a"))
                with self.assertRaises(NotFound):
                    await space.get(sbx.id)

        asyncio.run(main())


if __name__ == "__main__":
    unittest.main()
