"""``python -m fdp.env``: what fdp sees, one line per item, every FDP_* setting shown."""

import torch

import fdp.env


def test_fdp_env_prints_what_fdp_sees_with_each_setting(monkeypatch, capsys):
    monkeypatch.setenv("FDP_STALL_S", "7")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("FDP_DEBUG", raising=False)
    assert fdp.env.main([]) == 0
    lines = dict(line.split(None, 1) for line in capsys.readouterr().out.strip().splitlines())
    assert set(lines) == set(fdp.env.describe()) >= {"fdp", "torch", "backend", "world", "kernels", *fdp.env.SETTINGS}
    assert lines["FDP_STALL_S"] == "7"
    assert lines["FDP_DEBUG"].startswith("(default) 0")
    assert "WORLD_SIZE=4" in lines["world"] and "RANK=1" in lines["world"]
    assert lines["torch"].startswith(torch.__version__)
    assert lines["backend"].split()[0] in ("gloo", "nccl")
