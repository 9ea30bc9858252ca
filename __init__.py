"""Not the fdp package: the root folder of fdp's source checkout (the package is ``fdp/``).

Python imports this file as ``fdp`` when a script runs from the folder that holds the
checkout (``cd ~/src && python train.py`` with the clone at ``~/src/fdp``): the script's
folder is first on ``sys.path``, and an editable install (``pip install -e``, ``make``)
finds the real package through a finder that setuptools appends to ``sys.meta_path``,
after Python's own path search, so it is never asked. Without this file the folder was
imported as an empty namespace package and the script failed with "module 'fdp' has no
attribute 'init'". This file hands over to the installed package instead: it imports it
with the checkout's parent folder hidden from ``sys.path`` and replaces itself in
``sys.modules``, which is what ``import fdp`` then returns. Without an installed fdp it
raises an ImportError that says so.
"""

import importlib
import os
import sys


def _hand_over() -> None:
    root = os.path.dirname(os.path.abspath(__file__))
    parent = os.path.dirname(root)
    saved = list(sys.path)
    placeholder = sys.modules.pop(__name__)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != parent]
    try:
        real = importlib.import_module(__name__)
    except ModuleNotFoundError as e:
        sys.modules[__name__] = placeholder
        if e.name != __name__:  # fdp is there, something it needs is not: that error
            raise
        raise ImportError(
            f"'import fdp' found the folder {root}, fdp's source checkout, because the script "
            f"runs from {parent}; the package inside it is not installed. Install it "
            f"(pip install -e {root}, or make in {root}), or run from another folder."
        ) from e
    finally:
        sys.path[:] = saved
    sys.modules[__name__] = real


if __name__ == "fdp":
    _hand_over()
