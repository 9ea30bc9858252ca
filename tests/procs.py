"""Launch subprocesses (torchrun jobs) in their own process group, and kill the whole group
if they outlive their timeout: a hung torchrun must not leave orphaned ranks behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TRITON_INTERPRET")
ROOT = Path(__file__).resolve().parents[1]


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without torchrun's variables, with one thread per rank, importing
    fdp from this checkout (a script run from another folder would otherwise import the
    installed fdp, which in a git worktree is the main checkout's)."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


def torchrun(nproc: int, *args: str, max_restarts: int = 0) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            f"--max-restarts={max_restarts}", *args]


def run(cmd: list[str], *, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)`` that kills the process group on timeout."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True, **kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise AssertionError(
                f"{' '.join(cmd)} did not finish within {timeout}s (killed)\n--- stdout\n{out[-2000:]}"
                f"\n--- stderr\n{err[-4000:]}"
            ) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
