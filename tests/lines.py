"""How many Python lines a call runs inside the fdp package (the tests that say "no Python
per leaf" compare this count for a small and a large tree)."""

import os
import sys

import fdp

PACKAGE = os.path.dirname(fdp.__file__)


def fdp_lines(call) -> int:
    """Run ``call()`` and return the number of Python lines it executed in fdp's files."""
    lines = 0

    def count(frame, event, arg):
        nonlocal lines
        lines += event == "line"
        return count

    previous = sys.gettrace()
    sys.settrace(lambda f, e, a: count if f.f_code.co_filename.startswith(PACKAGE) else None)
    try:
        call()
    finally:
        sys.settrace(previous)
    return lines
