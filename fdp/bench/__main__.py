"""``python -m fdp.bench [kernels|replicas|soak|micro|compile|optim|gpu|predict|validate|loop|sharded|large|overlap] ...``: benchmarks that run fdp
beside its peer in one run.

Without a subcommand: the model benchmark against torch DDP (``fdp.bench.models``).
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = ("kernels", "replicas", "soak", "micro", "compile", "optim", "gpu", "predict", "validate", "loop",
               "sharded", "large", "overlap")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        module = importlib.import_module(f"{__package__}.{argv[0]}")
        return module.main(argv[1:])
    from . import models

    return models.main(argv)


if __name__ == "__main__":
    sys.exit(main())
