"""The official `e2b-code-interpreter` SDK against space's `code-interpreter` template
(issue 13, decision 0025). Run by the Rust integration test
`e2b::the_code_interpreter_sdk_runs_code_in_kernels`, which builds the template first. Every
call is the SDK's own; `Sandbox.create()` names E2B's template `code-interpreter-v1`.
"""

import unittest

from e2b import NotFoundException, SandboxException
from e2b_code_interpreter import Sandbox

from test_sdk import port_request


class CodeInterpreter(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.sbx = Sandbox.create()

    @classmethod
    def tearDownClass(cls):
        cls.sbx.kill()

    def test_state_carries_over_between_runs(self):
        self.sbx.run_code("x = 1")
        self.assertEqual(self.sbx.run_code("x + 1").text, "2")

    def test_stdout_stderr_results_and_the_execution_count(self):
        seen = []
        ex = self.sbx.run_code(
            "import sys\nprint('out')\nprint('err', file=sys.stderr)\n"
            "from IPython.display import display, HTML\ndisplay(HTML('<b>hi</b>'))\n21 * 2",
            on_stdout=lambda m: seen.append(m.line),
        )
        self.assertEqual(ex.logs.stdout, ["out\n"])
        self.assertEqual(ex.logs.stderr, ["err\n"])
        self.assertEqual(seen, ["out\n"])
        self.assertEqual([r.html for r in ex.results if not r.is_main_result], ["<b>hi</b>"])
        self.assertEqual(ex.text, "42")
        self.assertIsNone(ex.error)
        self.assertGreaterEqual(ex.execution_count, 1)

    def test_an_exception_is_an_execution_error(self):
        ex = self.sbx.run_code("1 / 0")
        self.assertEqual(ex.error.name, "ZeroDivisionError")
        self.assertEqual(ex.error.value, "division by zero")
        self.assertIn("ZeroDivisionError", ex.error.traceback)
        # The kernel lives on.
        self.assertEqual(self.sbx.run_code("'still here'").text, "'still here'")

    def test_envs_apply_to_one_run_only(self):
        code = "import os; os.environ.get('SPACE_X', 'unset')"
        self.assertEqual(self.sbx.run_code(code, envs={"SPACE_X": "1"}).text, "'1'")
        self.assertEqual(self.sbx.run_code(code).text, "'unset'")

    def test_contexts_are_separate_kernels(self):
        ctx = self.sbx.create_code_context(cwd="/tmp")
        try:
            self.assertEqual(ctx.cwd, "/tmp")
            self.sbx.run_code("y = 'ctx'", context=ctx)
            self.assertEqual(self.sbx.run_code("y", context=ctx).text, "'ctx'")
            self.assertEqual(self.sbx.run_code("import os; os.getcwd()", context=ctx).text, "'/tmp'")
            self.assertEqual(self.sbx.run_code("'y' in globals()").text, "False")
            self.assertIn(ctx.id, [c.id for c in self.sbx.list_code_contexts()])
            self.sbx.restart_code_context(ctx)
            self.assertEqual(self.sbx.run_code("'y' in globals()", context=ctx).text, "False")
        finally:
            self.sbx.remove_code_context(ctx)
        self.assertNotIn(ctx.id, [c.id for c in self.sbx.list_code_contexts()])
        with self.assertRaises(NotFoundException):
            self.sbx.run_code("1", context=ctx)

    def test_the_sandbox_is_an_ordinary_e2b_sandbox(self):
        self.sbx.run_code("open('/home/user/from_kernel.txt', 'w').write('k')")
        self.assertEqual(self.sbx.files.read("/home/user/from_kernel.txt"), "k")
        self.assertEqual(self.sbx.commands.run("whoami").stdout, "user\n")

    def test_bad_input_is_refused_and_disturbs_nothing(self):
        with self.assertRaises(SandboxException):
            self.sbx.run_code("1", language="r")
        # The port needs the sandbox's traffic token (or its envd token).
        r = port_request(self.sbx, 49999, "/execute", token="", method="POST", json={"code": "1"})
        self.assertEqual(r.status_code, 401)
        r = port_request(self.sbx, "not-a-port", "/execute", method="POST")
        self.assertEqual(r.status_code, 400)
        self.assertEqual(self.sbx.run_code("x = 5; x").text, "5")


if __name__ == "__main__":
    unittest.main()
