"""Tenants through the official `e2b` Python SDK (issue 15, decision 0040).

Run by the Rust integration test `tenants::tenant_keys_through_the_cli_and_the_e2b_sdk`, which
creates tenants team-a and team-b and passes a tenant key of each (in E2B's form) as
KEY_A and KEY_B.
"""

import os
import unittest

from e2b import Sandbox
from e2b.exceptions import NotFoundException

KEY_A = os.environ["KEY_A"]
KEY_B = os.environ["KEY_B"]


class Tenants(unittest.TestCase):
    def test_a_tenant_sees_and_reaches_only_its_own_sandboxes(self):
        a = Sandbox.create(api_key=KEY_A, timeout=120)
        b = Sandbox.create(api_key=KEY_B, timeout=120)
        try:
            self.assertEqual(a.commands.run("echo a").stdout, "a\n")
            listed = [s.sandbox_id for s in Sandbox.list(api_key=KEY_A).next_items()]
            self.assertEqual(listed, [a.sandbox_id])
            # B's sandbox, by its id, is as missing to A as one that never existed.
            with self.assertRaises(NotFoundException):
                Sandbox.connect(b.sandbox_id, api_key=KEY_A)
            with self.assertRaises(NotFoundException):
                Sandbox.get_info(b.sandbox_id, api_key=KEY_A)
            self.assertFalse(Sandbox.kill(b.sandbox_id, api_key=KEY_A))
            # Nothing happened to it.
            self.assertTrue(b.is_running())
            self.assertEqual(b.commands.run("echo b").stdout, "b\n")
        finally:
            a.kill()
            b.kill()

    def test_a_tenants_snapshots_are_its_own_templates(self):
        a = Sandbox.create(api_key=KEY_A, timeout=120)
        made = []
        try:
            a.files.write("/home/user/s.txt", "a's file")
            # A tenant's templates are named TENANT.NAME: the name is completed.
            info = a.create_snapshot(name="snap")
            self.assertEqual(info.snapshot_id, "team-a.snap")
            auto = a.create_snapshot()
            self.assertTrue(auto.snapshot_id.startswith("team-a.snapshot-"), auto.snapshot_id)
            mine = sorted(s.snapshot_id for s in Sandbox.list_snapshots(api_key=KEY_A).next_items())
            self.assertEqual(mine, sorted(["team-a.snap", auto.snapshot_id]))
            self.assertEqual(list(Sandbox.list_snapshots(api_key=KEY_B).next_items()), [])
            child = Sandbox.create(template="team-a.snap", api_key=KEY_A, timeout=120)
            made.append(child)
            self.assertEqual(child.files.read("/home/user/s.txt"), "a's file")
            # To B it is a template that does not exist.
            with self.assertRaises(Exception) as cm:
                Sandbox.create(template="team-a.snap", api_key=KEY_B, timeout=120)
            self.assertIn("team-a.snap not found", str(cm.exception))
            self.assertFalse(Sandbox.delete_snapshot("team-a.snap", api_key=KEY_B))
            child.kill()
            made.clear()
            self.assertTrue(Sandbox.delete_snapshot("team-a.snap", api_key=KEY_A))
            self.assertTrue(Sandbox.delete_snapshot(auto.snapshot_id, api_key=KEY_A))
            self.assertFalse(Sandbox.delete_snapshot("team-a.snap", api_key=KEY_A))
        finally:
            for c in made:
                c.kill()
            a.kill()


if __name__ == "__main__":
    unittest.main()
