"""fdp is quiet by default; FDP_LOG=INFO prints rank-prefixed lines, the plan summary first."""

import subprocess
import sys

import pytest
from procs import clean_env

pytestmark = pytest.mark.multiprocess  # a fresh python each: what fdp prints from its import on

SCRIPT = "import torch, fdp; fdp.Reducer({'w': torch.zeros(300000), 'b': torch.zeros(10)})"


@pytest.fixture(scope="module")
def runs():
    """The script without and with FDP_LOG=INFO, both started at once: {level: (code, out, err)}."""
    envs = {"default": clean_env(), "INFO": clean_env(FDP_LOG="INFO")}
    procs = {level: subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env) for level, env in envs.items()}
    outputs = {level: p.communicate(timeout=60) for level, p in procs.items()}
    return {level: (procs[level].returncode, *outputs[level]) for level in procs}


@pytest.mark.slow  # (two python launches)
def test_quiet_by_default(runs):
    code, out, err = runs["default"]
    assert code == 0 and err == "" and out == "", (code, out, err)


@pytest.mark.slow  # (two python launches)
def test_fdp_log_info_prints_the_bucket_plan_with_the_rank(runs):
    code, out, err = runs["INFO"]
    assert code == 0, err
    lines = err.splitlines()
    assert lines[0].startswith("[fdp rank 0] Reducer (hook allreduce, world 1): BucketPlan(2 leaves in 1 buckets")
    assert "bucket 0: torch.float32 cpu 1.144 MiB, 2 leaves (['b'] .. ['w'])" in err
