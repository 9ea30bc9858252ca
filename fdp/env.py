"""``python -m fdp.env``: what fdp sees here, in one screen.

The versions (fdp, torch, Python, Triton), the devices and the backend ``fdp.init()`` would
pick, the world torchrun describes (or a world of one), the threads torch computes with, the
flatten kernels each device gets, and every ``FDP_*`` setting as fdp uses it, with the
value set (``INVALID`` when fdp cannot use it) or the default. Paste it into an issue; compare it between two machines.

    $ python -m fdp.env
    fdp        0.x (/path/to/fdp)
    torch      2.13.0+cpu   (CUDA: no)
    ...
"""

from __future__ import annotations

import os
import platform
import sys
import warnings
from typing import Any

import torch

# Every environment variable fdp reads, with what it does when unset.
SETTINGS = {
    "FDP_DEBUG": "0: no collective fingerprints",
    "FDP_STALL_S": "5: seconds a gloo collective waits before the ranks compare where they wait",
    "FDP_LOG": "unset: no log lines",
    "FDP_KERNELS": "unset: Triton for CUDA tensors when installed, torch ops otherwise",
    "FDP_MALLOC": "unset: fdp.init tunes glibc's malloc thresholds",
}


def _in_use(key: str) -> str:
    """What fdp makes of ``key``'s value here, as it will use it (and whether the value is valid)."""
    from ._comm.lifetime import MALLOC_MODES
    from ._comm.stall import stall_seconds
    from ._log import debug_mode

    raw = os.environ.get(key)
    if key == "FDP_DEBUG":
        return "on: collective fingerprints checked" if debug_mode() else "off"
    if key == "FDP_STALL_S":
        try:
            valid = raw is None or float(raw) >= 0
        except ValueError:
            valid = False
        with warnings.catch_warnings():  # (said here, in the line itself)
            warnings.simplefilter("ignore")
            seconds = stall_seconds()
        used = "off (no stall check)" if not seconds else f"{seconds:g} s"
        return used if valid else f"{used}   (INVALID: {raw!r} is not a number of seconds >= 0)"
    if key == "FDP_LOG":
        levels = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
        if not raw:
            return "off"
        return f"{raw.upper()} lines to stderr" if raw.upper() in levels else f"INVALID: {raw!r} (one of {levels})"
    if key == "FDP_KERNELS":
        return "auto" if not raw else raw if raw in ("torch", "triton", "auto") else (
            f"INVALID: {raw!r} (torch, triton or auto)")
    if key == "FDP_MALLOC":
        return "keep (tuned)" if not raw else raw if raw in MALLOC_MODES else f"INVALID: {raw!r} (keep or os)"
    return raw or ""


# What torchrun sets, and the threads' variables torch reads at import.
WORLD = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
THREADS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def describe() -> dict[str, Any]:
    """What ``python -m fdp.env`` prints, as a dict (stable keys; values are strings)."""
    import fdp

    cuda = torch.cuda.is_available()
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    devices = ["cpu"] + [f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count())]
    kernels = {"cpu": _kernel_name(torch.device("cpu"))}
    if cuda:
        kernels["cuda"] = _kernel_name(torch.device("cuda"))
    world = {k: os.environ[k] for k in WORLD if k in os.environ}
    return {
        "fdp": f"{getattr(fdp, '__version__', '?')} ({os.path.dirname(fdp.__file__)})",
        "torch": f"{torch.__version__}   (CUDA: {torch.version.cuda if cuda else 'no'})",
        "python": f"{platform.python_version()} on {platform.system()} {platform.machine()}",
        "triton": triton_version + ("   (TRITON_INTERPRET=1: kernels run on CPU tensors)"
                                    if os.environ.get("TRITON_INTERPRET") == "1" else ""),
        "devices": ", ".join(devices),
        "backend": ("nccl" if cuda else "gloo") + "   (what fdp.init() picks here)",
        "world": (", ".join(f"{k}={v}" for k, v in world.items()) if "WORLD_SIZE" in world
                  else "a world of one (no torchrun variables)"),
        "distributed": ("initialised" if torch.distributed.is_available() and torch.distributed.is_initialized()
                        else "not initialised"),
        "threads": f"{torch.get_num_threads()} intra-op, {torch.get_num_interop_threads()} inter-op"
                   + "".join(f", {k}={os.environ[k]}" for k in THREADS if k in os.environ),
        "cpus": str(os.cpu_count()),
        "kernels": ", ".join(f"{d}: {k}" for d, k in kernels.items()),
        **{k: (f"{_in_use(k)}   (set: {os.environ[k]!r})" if k in os.environ else f"{_in_use(k)}   (default; {v})")
           for k, v in SETTINGS.items()},
    }


def _kernel_name(device: torch.device) -> str:
    import fdp.kernels

    try:
        return fdp.kernels.select(device)
    except Exception as e:  # noqa: BLE001 - e.g. FDP_KERNELS=triton without Triton: say why
        return f"none ({e})"


def main(argv: list[str] | None = None) -> int:
    width = max(len(k) for k in describe())
    for key, value in describe().items():
        print(f"{key:<{width}}  {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
