"""The official `e2b` SDK's filesystem calls against a real spaced (issue 13, increment 2).

Run by `e2b::the_official_python_sdk_runs_against_space` with `test_sdk.py`.
"""

import hashlib
import io
import os
import time
import unittest

import httpx
from e2b import (
    FileType,
    FilesystemEventType,
    InvalidArgumentException,
    NotFoundException,
    Sandbox,
)

URL = os.environ["E2B_API_URL"]


class Files(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.sbx = Sandbox.create()

    @classmethod
    def tearDownClass(cls):
        cls.sbx.kill()

    def test_write_read_and_owner(self):
        info = self.sbx.files.write("/home/user/notes/a.txt", "hello\n")
        self.assertEqual((info.path, info.name), ("/home/user/notes/a.txt", "a.txt"))
        self.assertEqual(self.sbx.files.read("/home/user/notes/a.txt"), "hello\n")
        self.assertEqual(bytes(self.sbx.files.read("/home/user/notes/a.txt", format="bytes")), b"hello\n")
        # Written as the default user, so the user's commands may change it.
        r = self.sbx.commands.run("stat -c %U /home/user/notes/a.txt; echo more >> /home/user/notes/a.txt")
        self.assertEqual(r.stdout, "user\n")
        self.assertEqual(self.sbx.files.read("/home/user/notes/a.txt"), "hello\nmore\n")
        root = self.sbx.files.write("/tmp/r.txt", "x", user="root")
        self.assertEqual(self.sbx.files.get_info(root.path).owner, "root")

    def test_write_many_and_octet_stream(self):
        infos = self.sbx.files.write_files(
            [
                {"path": "/home/user/m/1.txt", "data": "one"},
                {"path": "/home/user/m/2.bin", "data": b"\x00\x01two"},
            ]
        )
        self.assertEqual([i.path for i in infos], ["/home/user/m/1.txt", "/home/user/m/2.bin"])
        self.assertEqual(self.sbx.files.read("/home/user/m/2.bin", format="bytes"), b"\x00\x01two")
        self.sbx.files.write("/home/user/m/3.txt", io.BytesIO(b"streamed"))
        self.assertEqual(self.sbx.files.read("/home/user/m/3.txt"), "streamed")
        self.sbx.files.write("/home/user/m/4.txt", b"zipped", gzip=True)
        self.assertEqual(self.sbx.files.read("/home/user/m/4.txt"), "zipped")

    def test_a_large_file_round_trips(self):
        data = os.urandom(24 * 1024 * 1024)
        self.sbx.files.write("/home/user/big.bin", data)
        got = bytes(self.sbx.files.read("/home/user/big.bin", format="bytes"))
        self.assertEqual(hashlib.sha256(got).hexdigest(), hashlib.sha256(data).hexdigest())
        r = self.sbx.commands.run("sha256sum /home/user/big.bin | cut -d' ' -f1")
        self.assertEqual(r.stdout.strip(), hashlib.sha256(data).hexdigest())
        stream = self.sbx.files.read("/home/user/big.bin", format="stream")
        self.assertEqual(sum(len(c) for c in stream), len(data))

    def test_list_stat_make_dir_rename_remove(self):
        self.assertTrue(self.sbx.files.make_dir("/home/user/d/e"))
        self.assertFalse(self.sbx.files.make_dir("/home/user/d/e"))
        self.sbx.files.write("/home/user/d/e/f.txt", "f")
        self.sbx.commands.run("ln -s e/f.txt /home/user/d/link")
        top = {e.name: e for e in self.sbx.files.list("/home/user/d")}
        self.assertEqual(set(top), {"e", "link"})
        self.assertEqual(top["e"].type, FileType.DIR)
        self.assertEqual(top["link"].symlink_target, "e/f.txt")
        deep = {e.path for e in self.sbx.files.list("/home/user/d", depth=2)}
        self.assertIn("/home/user/d/e/f.txt", deep)
        info = self.sbx.files.get_info("/home/user/d/e/f.txt")
        self.assertEqual((info.type, info.size, info.owner), (FileType.FILE, 1, "user"))
        self.assertEqual(info.permissions, "-rw-r--r--")
        moved = self.sbx.files.rename("/home/user/d/e/f.txt", "/home/user/d/g.txt")
        self.assertEqual(moved.path, "/home/user/d/g.txt")
        self.assertTrue(self.sbx.files.exists("/home/user/d/g.txt"))
        self.assertFalse(self.sbx.files.exists("/home/user/d/e/f.txt"))
        self.sbx.files.remove("/home/user/d")
        self.assertFalse(self.sbx.files.exists("/home/user/d"))

    def test_missing_paths_are_not_found(self):
        with self.assertRaises(NotFoundException):
            self.sbx.files.read("/home/user/nope.txt")
        with self.assertRaises(NotFoundException):
            self.sbx.files.get_info("/home/user/nope.txt")
        with self.assertRaises(NotFoundException):
            self.sbx.files.list("/home/user/nope")
        with self.assertRaises(NotFoundException):
            self.sbx.files.rename("/home/user/nope", "/home/user/x")

    def test_relative_paths_start_at_home_and_bad_ones_are_invalid(self):
        self.sbx.files.write("rel/r.txt", "relative")
        self.assertEqual(self.sbx.files.read("/home/user/rel/r.txt"), "relative")
        self.assertEqual(self.sbx.files.read("rel/r.txt", user="user"), "relative")
        with self.assertRaises(InvalidArgumentException):
            self.sbx.files.write("/home/user/\x00bad", "x")
        with self.assertRaises(InvalidArgumentException):
            self.sbx.files.get_info("/home/user/\x00bad")

    def test_file_metadata_is_kept_as_user_e2b_xattrs(self):
        # envd 0.6.2: X-Metadata-* upload headers, stored as user.e2b.<key>, keys lowercased.
        info = self.sbx.files.write("/home/user/meta.txt", "m", metadata={"Owner": "ann", "stage": "raw"})
        self.assertEqual(info.metadata, {"owner": "ann", "stage": "raw"})
        self.assertEqual(self.sbx.files.get_info("/home/user/meta.txt").metadata, {"owner": "ann", "stage": "raw"})
        listed = {e.name: e.metadata for e in self.sbx.files.list("/home/user")}
        self.assertEqual(listed["meta.txt"], {"owner": "ann", "stage": "raw"})
        r = self.sbx.commands.run(
            "python3 -c \"import os; print(os.getxattr('/home/user/meta.txt', 'user.e2b.owner').decode())\""
        )
        self.assertEqual(r.stdout, "ann\n")
        # Set out of band, read back too; a file with none has none.
        self.sbx.commands.run(
            "python3 -c \"import os; os.setxattr('/home/user/meta.txt', 'user.e2b.extra', b'1')\""
        )
        self.assertEqual(self.sbx.files.get_info("/home/user/meta.txt").metadata["extra"], "1")
        self.sbx.files.write("/home/user/plain.txt", "p")
        self.assertIsNone(self.sbx.files.get_info("/home/user/plain.txt").metadata)
        # Several files, one map; a multipart upload.
        infos = self.sbx.files.write_files(
            [{"path": "/home/user/m1", "data": "1"}, {"path": "/home/user/m2", "data": "2"}],
            metadata={"batch": "7"},
        )
        self.assertEqual([i.metadata for i in infos], [{"batch": "7"}, {"batch": "7"}])
        # A key that is no HTTP token is refused by the SDK; a value too long by the sandbox.
        with self.assertRaises(InvalidArgumentException):
            self.sbx.files.write("/home/user/bad", "x", metadata={"a b": "c"})
        with self.assertRaises(Exception):
            self.sbx.files.write("/home/user/bad", "x", metadata={"k": "v" * 5000})
        self.assertFalse(self.sbx.files.exists("/home/user/bad"))

    def test_signed_urls(self):
        self.sbx.files.write("/home/user/s.txt", "signed")
        url = self.sbx.download_url("/home/user/s.txt", use_signature_expiration=60)
        r = httpx.get(url, headers={"E2b-Sandbox-Id": self.sbx.sandbox_id})
        self.assertEqual((r.status_code, r.text), (200, "signed"))
        # A signature for one path opens no other.
        other = url.replace("s.txt", "t.txt")
        r = httpx.get(other, headers={"E2b-Sandbox-Id": self.sbx.sandbox_id})
        self.assertEqual(r.status_code, 401)
        up = self.sbx.upload_url("/home/user/u.txt", use_signature_expiration=60)
        r = httpx.post(up, files={"file": ("u.txt", b"uploaded")},
                       headers={"E2b-Sandbox-Id": self.sbx.sandbox_id})
        self.assertEqual(r.status_code, 200, r.text)
        self.assertEqual(self.sbx.files.read("/home/user/u.txt"), "uploaded")


class Watch(unittest.TestCase):
    def test_watch_dir_sees_create_write_rename_remove(self):
        sbx = Sandbox.create()
        try:
            sbx.files.make_dir("/home/user/w/sub")
            handle = sbx.files.watch_dir("/home/user/w", recursive=True)
            sbx.commands.run(
                "cd /home/user/w && echo a > a.txt && echo b >> a.txt && "
                "mv a.txt b.txt && echo s > sub/s.txt && rm b.txt"
            )
            events, deadline = [], time.time() + 10
            while time.time() < deadline:
                events += handle.get_new_events()
                if any(e.name == "sub/s.txt" for e in events) and any(
                    e.type == FilesystemEventType.REMOVE for e in events
                ):
                    break
                time.sleep(0.1)
            handle.stop()
            seen = {(e.name, e.type) for e in events}
            self.assertIn(("a.txt", FilesystemEventType.CREATE), seen)
            self.assertIn(("a.txt", FilesystemEventType.WRITE), seen)
            self.assertIn(("a.txt", FilesystemEventType.RENAME), seen)
            self.assertIn(("b.txt", FilesystemEventType.CREATE), seen)
            self.assertIn(("b.txt", FilesystemEventType.REMOVE), seen)
            self.assertIn(("sub/s.txt", FilesystemEventType.CREATE), seen)
            with self.assertRaises(Exception):
                handle.get_new_events()
        finally:
            sbx.kill()

    def test_the_async_sdk_streams_watch_dir(self):
        import asyncio

        from e2b import AsyncSandbox

        async def main():
            sbx = await AsyncSandbox.create()
            try:
                await sbx.files.make_dir("/home/user/aw")
                seen = []
                handle = await sbx.files.watch_dir(
                    "/home/user/aw", on_event=seen.append, recursive=True, timeout=0
                )
                await sbx.commands.run("mkdir /home/user/aw/d && echo x > /home/user/aw/d/f")
                for _ in range(100):
                    if any(e.name == "d/f" for e in seen):
                        break
                    await asyncio.sleep(0.1)
                await handle.stop()
                names = {(e.name, e.type) for e in seen}
                self.assertIn(("d", FilesystemEventType.CREATE), names)
                self.assertIn(("d/f", FilesystemEventType.CREATE), names)
            finally:
                await sbx.kill()

        asyncio.run(main())

    def test_watch_events_carry_the_entry_when_asked(self):
        # envd 0.6.3: include_entry.
        sbx = Sandbox.create()

        def until(handle, kind):
            events, deadline = [], time.time() + 10
            while time.time() < deadline:
                events += handle.get_new_events()
                if any(e.type == kind for e in events):
                    return events
                time.sleep(0.1)
            self.fail(f"no {kind} event: {events}")

        try:
            sbx.files.make_dir("/home/user/we")
            handle = sbx.files.watch_dir("/home/user/we", include_entry=True)
            sbx.commands.run("echo abc > /home/user/we/f.txt")
            created = [e for e in until(handle, FilesystemEventType.CREATE) if e.entry is not None]
            self.assertTrue(created)
            self.assertEqual(
                (created[0].entry.name, created[0].entry.path, created[0].entry.type),
                ("f.txt", "/home/user/we/f.txt", FileType.FILE),
            )
            sbx.commands.run("rm /home/user/we/f.txt")
            removed = [e for e in until(handle, FilesystemEventType.REMOVE) if e.type == FilesystemEventType.REMOVE]
            self.assertEqual([e.entry for e in removed], [None])
            handle.stop()
            # Without include_entry, no entries.
            handle = sbx.files.watch_dir("/home/user/we")
            sbx.commands.run("echo x > /home/user/we/g.txt")
            self.assertTrue(all(e.entry is None for e in until(handle, FilesystemEventType.CREATE)))
            handle.stop()
        finally:
            sbx.kill()

    def test_watching_a_missing_dir_is_not_found(self):
        sbx = Sandbox.create()
        try:
            with self.assertRaises(NotFoundException):
                sbx.files.watch_dir("/home/user/nope")
        finally:
            sbx.kill()


if __name__ == "__main__":
    unittest.main()
