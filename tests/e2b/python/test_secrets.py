"""E2B's secrets through the official `e2b` Python SDK (issue 13, decision 0027).

Run by the Rust integration test `e2b::e2b_secrets_reach_the_rule_host_and_never_the_sandbox`,
which starts spaced attached to the test's fake internet (tests/src/netlab.rs: api.example.test
serves HTTPS with the lab's CA, which spaced trusts upstream) and passes the value the lab's
server must receive in LAB_SECRET. That test then checks what the server received.
"""

import json
import os
import unittest

from e2b import Sandbox, SandboxException, Secret
from e2b.exceptions import SecretException, SecretNotFoundException

SECRET = os.environ["LAB_SECRET"]
NAME = "lab-api-token"


def rule(host, header, value):
    return {host: [{"transform": {"headers": {header: value}}}]}


class Secrets(unittest.TestCase):
    def test_1_secrets_are_made_versioned_listed_and_never_shown(self):
        info = Secret.create(NAME, "first-value", metadata={"team": "lab"})
        self.assertEqual((info.secret_id, info.name, info.version), (NAME, NAME, 1))
        self.assertEqual(info.metadata, {"team": "lab"})
        with self.assertRaises(SecretException):
            Secret.create(NAME, "again")
        info = Secret.update(NAME, SECRET)
        self.assertEqual(info.version, 2)
        self.assertEqual(info.metadata, {"team": "lab"}, "metadata kept when not given")
        self.assertEqual(Secret.get_info(NAME).version, 2)
        self.assertTrue(Secret.exists(NAME))
        listed = Secret.list().next_items()
        self.assertIn(NAME, [s.name for s in listed])
        shown = json.dumps([vars(s) for s in listed] + [vars(Secret.get_info(NAME))], default=str)
        self.assertNotIn(SECRET, shown)
        self.assertNotIn("first-value", shown)
        with self.assertRaises(SecretNotFoundException):
            Secret.get_info("no-such-secret")
        self.assertFalse(Secret.exists("no-such-secret"))
        for name, value in [("bad name", "v"), ("ok-name", ""), ("ok-name", "a\nb")]:
            with self.assertRaises(SecretException, msg=f"{name!r} {value!r}"):
                Secret.create(name, value)

    def test_2_a_rule_puts_the_value_in_the_header_and_nothing_in_the_sandbox(self):
        sbx = Sandbox.create(
            network={
                "rules": rule(
                    "api.example.test", "Authorization", f"Bearer {Secret.fill(NAME)}"
                )
            }
        )
        try:
            # The sandbox sends a header of its own: the proxy replaces it.
            r = sbx.commands.run(
                "curl -sS --max-time 10 -H 'Authorization: Bearer mine' "
                "https://api.example.test/quiet"
            )
            self.assertEqual((r.exit_code, r.stdout), (0, "ok"))
            # Plain HTTP and other hosts get nothing (the Rust side checks what arrived).
            r = sbx.commands.run(
                "curl -sS --max-time 10 http://api.example.test/plain; "
                "curl -sS --max-time 10 http://echo.example.test/other"
            )
            self.assertEqual(r.exit_code, 0, r.stderr)
            self.assertNotIn(SECRET, r.stdout)
            # Nothing inside holds the value, or a placeholder for it.
            r = sbx.commands.run("env; cat /proc/1/environ | tr '\\0' '\\n'", user="root")
            self.assertNotIn(SECRET, r.stdout)
            self.assertNotIn("spc_ph_", r.stdout)
        finally:
            sbx.kill()

    def test_3_rules_space_cannot_honour_are_refused(self):
        for rules, words in [
            (rule("api.example.test", "X-Key", Secret.fill("no-such-secret")), "not found"),
            (rule("203.0.113.10", "X-Key", Secret.fill(NAME)), "IP address"),
            (rule("api.example.test", "X-Key", "plain"), "carry a secret"),
        ]:
            with self.assertRaises(SandboxException) as cm:
                Sandbox.create(network={"rules": rules})
            self.assertIn(words, str(cm.exception))

    def test_4_destroyed_secrets_are_gone(self):
        self.assertTrue(Secret.destroy(NAME))
        self.assertFalse(Secret.exists(NAME))
        self.assertFalse(Secret.destroy(NAME))


if __name__ == "__main__":
    unittest.main()
