"""``fdp._internals.when_imported``: callbacks run once a module is imported, through a
finder on ``sys.meta_path`` that asks the other finders for the module's spec."""

import subprocess
import sys

from procs import clean_env

# Two watchers of one module, as two copies of fdp in one process (or another library with a
# finder that asks the others the same way) make: each asks the other, which must not ask it
# back, and both callbacks run once the module is imported.
TWO_WATCHERS = """
import sys
from fdp import _internals
ran = []
first, second = _internals._Watcher("json"), _internals._Watcher("json")
first.when_imported(lambda: ran.append("first"))
second.when_imported(lambda: ran.append("second"))
import json
assert sorted(ran) == ["first", "second"], ran
assert first not in sys.meta_path and second not in sys.meta_path
print("ok")
"""


def test_two_watchers_of_one_module_do_not_ask_each_other_forever_and_both_run():
    out = subprocess.run([sys.executable, "-c", TWO_WATCHERS], capture_output=True, text=True, timeout=120,
                         env=clean_env())
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
