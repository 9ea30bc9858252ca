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
    assert lines["FDP_STALL_S"] == "7 s   (set: '7')"  # (as fdp uses it, then as it was set)
    assert lines["FDP_DEBUG"].startswith("off   (default; 0")
    assert "WORLD_SIZE=4" in lines["world"] and "RANK=1" in lines["world"]
    assert lines["torch"].startswith(torch.__version__)
    assert lines["backend"].split()[0] in ("gloo", "nccl")


def test_fdp_env_says_which_settings_fdp_cannot_use_and_what_it_uses_instead(monkeypatch, capsys):
    monkeypatch.setenv("FDP_STALL_S", "abc")
    monkeypatch.setenv("FDP_KERNELS", "fast")
    monkeypatch.setenv("FDP_DEBUG", "yes")
    assert fdp.env.main([]) == 0
    lines = dict(line.split(None, 1) for line in capsys.readouterr().out.strip().splitlines())
    assert lines["FDP_STALL_S"].startswith("5 s   (INVALID: 'abc' is not a number of seconds"), lines
    assert lines["FDP_KERNELS"].startswith("INVALID: 'fast'"), lines
    assert lines["FDP_DEBUG"].startswith("on: collective fingerprints checked"), lines


def test_an_invalid_stall_setting_is_said_once_and_the_default_used(monkeypatch):
    import warnings

    from fdp._comm.stall import stall_seconds

    monkeypatch.setenv("FDP_STALL_S", "five")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert stall_seconds() == stall_seconds() == 5.0
    assert [str(w.message) for w in seen] == ["fdp: FDP_STALL_S='five' is not a number of seconds; using 5"]
