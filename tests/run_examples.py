"""Run several example scripts, one after another, in one world (for tests/test_examples.py).

    torchrun --standalone --nproc-per-node 2 tests/run_examples.py PLAN.json   # 2 ranks
    python tests/run_examples.py PLAN.json                                    # a world of one

PLAN.json is a list of jobs ``{"script": path, "args": [...], "cwd": folder, "label": name}``.
Every rank runs each job's script as ``__main__`` (``runpy``), with ``sys.argv`` set to the
script and its arguments and the working directory set to the job's folder, exactly the code a
user's ``torchrun ... examples/<script> <args>`` runs; only the process (its imports, its
``fdp.init()`` world) is shared by the jobs, which saves a launch of torchrun and the imports
of every rank (about 3-4 s) per job.

Each rank writes what a job prints to ``<cwd>/<label>.rank<r>.out``, and, when the job ends,
``<cwd>/<label>.rank<r>.exit``: ``0`` or the failure (the traceback, or the SystemExit's
code). A job that fails on any rank stops the whole run (the ranks may disagree about which
collective comes next): the later jobs leave no ``.exit`` file.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import sys
import traceback


def run_job(job: dict, rank: int) -> str | None:
    """Run one job on this rank; return None if it succeeded, else why it failed."""
    cwd, argv, path = os.getcwd(), sys.argv, list(sys.path)
    os.chdir(job["cwd"])
    sys.argv = [job["script"], *job["args"]]
    sys.path.insert(0, os.path.dirname(os.path.abspath(job["script"])))  # as `python script` does
    failure = None
    with open(f"{job['label']}.rank{rank}.out", "w") as out, contextlib.redirect_stdout(out):
        try:
            runpy.run_path(job["script"], run_name="__main__")
        except SystemExit as e:
            if e.code not in (None, 0):
                failure = f"SystemExit({e.code!r})"
        except BaseException:  # noqa: BLE001 - reported to the test, then the run stops
            failure = traceback.format_exc()
        finally:
            sys.stdout.flush()
    with open(f"{job['label']}.rank{rank}.exit", "w") as f:
        f.write("0" if failure is None else failure)
    os.chdir(cwd)
    sys.argv, sys.path[:] = argv, path
    return failure


def main() -> None:
    with open(sys.argv[1]) as f:
        jobs = json.load(f)
    rank = int(os.environ.get("RANK", 0))
    for job in jobs:
        failure = run_job(job, rank)
        if failure is not None:
            print(f"rank {rank}: {job['label']} failed:\n{failure}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(1)  # the other ranks may wait in a collective: torchrun stops them


if __name__ == "__main__":
    main()
