"""fdp is quiet by default; FDP_LOG=INFO prints rank-prefixed lines, the plan summary first."""

import subprocess
import sys

import pytest
from procs import clean_env

pytestmark = pytest.mark.multiprocess  # a fresh python each: what fdp prints from its import on

SCRIPT = "import torch, fdp; fdp.Reducer({'w': torch.zeros(300000), 'b': torch.zeros(10)})"


def test_quiet_by_default():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=clean_env(), timeout=60)
    assert out.returncode == 0 and out.stderr == "" and out.stdout == ""


def test_fdp_log_info_prints_the_bucket_plan_with_the_rank():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         env=clean_env(FDP_LOG="INFO"), timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    assert lines[0].startswith("[fdp rank 0] Reducer (hook allreduce, world 1): BucketPlan(2 leaves in 1 buckets")
    assert "bucket 0: torch.float32 cpu 1.144 MiB, 2 leaves (['b'] .. ['w'])" in out.stderr
