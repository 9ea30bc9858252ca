"""``python -m fdp.bench [kernels|replicas|soak|optim|gpu] ...``: benchmarks that run fdp beside its peer in one run.

Without a subcommand: the model benchmark against torch DDP (``fdp.bench.models``).
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "kernels":
        from . import kernels

        return kernels.main(argv[1:])
    if argv and argv[0] == "replicas":
        from . import replicas

        return replicas.main(argv[1:])
    if argv and argv[0] == "soak":
        from . import soak

        return soak.main(argv[1:])
    if argv and argv[0] == "optim":
        from . import optim

        return optim.main(argv[1:])
    if argv and argv[0] == "gpu":
        from . import gpu

        return gpu.main(argv[1:])
    from . import models

    return models.main(argv)


if __name__ == "__main__":
    sys.exit(main())
