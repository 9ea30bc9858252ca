"""The soak run, short: no drift between replicas, resident memory flat after warm-up.

The full run is `python -m fdp.bench soak` (2,000 steps); CI runs 300.
"""

import pytest

from fdp.bench import soak


@pytest.mark.slow  # (a soak)
def test_short_soak_has_no_drift_and_flat_memory(capsys):
    code = soak.main(["--steps", "300", "--check-every", "50", "--width", "128"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.count("6 replica checks passed") == 2 and "flat" in out
