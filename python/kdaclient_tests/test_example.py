"""examples/kimi_linear_stack.py end to end (NumPy projections, small sizes): it checks its
own outputs against float64 references and exits 0 only when they match."""
import os
import subprocess
import sys
import unittest

import kdaclient
from . import REPO, Daemon

EXAMPLES = os.environ.get("KDAD_EXAMPLES_DIR") or os.path.join(REPO, "examples")
SCRIPT = os.path.join(EXAMPLES, "kimi_linear_stack.py")


@unittest.skipUnless(os.path.exists(SCRIPT), "no %s (set KDAD_EXAMPLES_DIR)" % SCRIPT)
class ExampleTest(unittest.TestCase):
    def test_kimi_linear_stack(self):
        d = Daemon(heads=32).start()
        try:
            env = dict(os.environ)
            pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(kdaclient.__file__)))
            env["PYTHONPATH"] = pkg_root + os.pathsep + env.get("PYTHONPATH", "")
            p = subprocess.run([sys.executable, SCRIPT, "--socket", d.sock], env=env,
                               capture_output=True, text=True, timeout=600)
        finally:
            d.stop()
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn("KDA outputs vs float64 token loop", p.stdout)
        self.assertTrue(p.stdout.rstrip().endswith("OK"), p.stdout)


if __name__ == "__main__":
    unittest.main()
