"""The official `e2b` Python SDK reaching space by domain, over TLS (decision 0030).

Run by the Rust integration test `e2b::the_sdks_reach_space_by_domain_over_tls`. It
starts spaced with `--e2b-domain` in a network namespace whose DNS (the test's own server)
answers the domain and every name under it with spaced's address, and sets only what a user
would: E2B_API_KEY and E2B_DOMAIN (`space e2b env --domain`), and SSL_CERT_FILE naming the CA
`space e2b ca` printed. No E2B_API_URL or E2B_SANDBOX_URL: the SDK builds `https://api.DOMAIN`
and `https://49983-ID.DOMAIN` itself, as it does for E2B's cloud.
"""

import os
import ssl
import time
import unittest

import httpx
from e2b import CommandExitException, Sandbox, SandboxQuery

DOMAIN = os.environ["E2B_DOMAIN"]
TLS = ssl.create_default_context(cafile=os.environ["SSL_CERT_FILE"])


class ByDomain(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        assert "E2B_API_URL" not in os.environ and "E2B_SANDBOX_URL" not in os.environ
        cls.sbx = Sandbox.create(metadata={"suite": "domain"})

    @classmethod
    def tearDownClass(cls):
        cls.sbx.kill()

    def test_the_sdk_builds_its_addresses_from_the_domain(self):
        self.assertEqual(self.sbx.sandbox_domain, DOMAIN)
        self.assertEqual(
            self.sbx.envd_api_url, f"https://49983-{self.sbx.sandbox_id}.{DOMAIN}"
        )
        self.assertEqual(self.sbx.get_host(8000), f"8000-{self.sbx.sandbox_id}.{DOMAIN}")

    def test_commands_files_and_the_control_api(self):
        r = self.sbx.commands.run("echo hi; whoami")
        self.assertEqual((r.stdout, r.exit_code), ("hi\nuser\n", 0))
        with self.assertRaises(CommandExitException):
            self.sbx.commands.run("exit 3")
        self.sbx.files.write("/home/user/by-domain.txt", "over TLS")
        self.assertEqual(self.sbx.files.read("/home/user/by-domain.txt"), "over TLS")
        listed = Sandbox.list(query=SandboxQuery(metadata={"suite": "domain"})).next_items()
        self.assertEqual([s.sandbox_id for s in listed], [self.sbx.sandbox_id])
        self.assertTrue(self.sbx.is_running())

    def test_a_port_of_the_sandbox_by_its_host(self):
        self.sbx.commands.run("mkdir -p /tmp/www && echo served > /tmp/www/i.txt")
        self.sbx.commands.run(
            "cd /tmp/www && python3 -m http.server 8000 --bind 127.0.0.1", background=True
        )
        url = f"https://{self.sbx.get_host(8000)}/i.txt"
        token = {"E2B-Traffic-Access-Token": self.sbx.traffic_access_token}
        with httpx.Client(verify=TLS) as c:
            for _ in range(100):
                r = c.get(url, headers=token)
                if r.status_code == 200:
                    break
                time.sleep(0.1)
            self.assertEqual((r.status_code, r.text), (200, "served\n"))
            # Without the sandbox's token, or with a header naming another sandbox, nothing.
            self.assertEqual(c.get(url).status_code, 401)
            r = c.get(url, headers={**token, "E2b-Sandbox-Id": "a" * 20})
            self.assertEqual((r.status_code, r.text), (200, "served\n"))

    def test_hosts_that_name_nothing(self):
        with httpx.Client(verify=TLS) as c:
            r = c.get(f"https://www.{DOMAIN}/health")
            self.assertEqual(r.status_code, 400)
            self.assertIn("is not a host of this server", r.json()["message"])
            r = c.get(f"https://49983-{'0' * 20}.{DOMAIN}/health")
            self.assertEqual(r.status_code, 502)
            # The API's own paths answer at api.DOMAIN; a sandbox host is envd's, not the API's.
            self.assertEqual(c.get(f"https://api.{DOMAIN}/healthz").status_code, 200)
            r = c.get(f"https://49983-{self.sbx.sandbox_id}.{DOMAIN}/v1/sandboxes")
            self.assertNotEqual(r.status_code, 200)


if __name__ == "__main__":
    unittest.main()
