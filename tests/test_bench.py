"""The benchmarks run (at a tiny size) and print the columns the docs and notes quote.

These check the harness, not the speed: speed claims come from full runs on a quiet machine
(`python -m fdp.bench`, recorded in docs/performance.md), never from timed tests.
"""

import json

from fdp.bench import kernels as kernels_bench
from fdp.bench import models as models_bench


def test_model_benchmark_prints_every_kind_with_ratio_exposed_and_memory(tmp_path, capsys):
    out_json = tmp_path / "bench.json"
    code = models_bench.main(["--models", "tiny1000", "--steps", "2", "--warmup", "1",
                              "--json", str(out_json), "--plot", str(tmp_path / "bench.png")])
    text = capsys.readouterr().out
    assert code == 0
    header = text.splitlines()[0].split()
    assert header == ["model", "step", "ms", "vs", "ddp", "exposed", "ms", "comm", "cpu", "faults", "peak", "MiB",
                      "opt", "MiB"]
    rows = {line.split()[1]: line.split() for line in text.splitlines() if line.startswith("tiny1000")}
    assert set(rows) == set(models_bench.KINDS)
    assert float(rows["ddp"][3]) == 1.0  # the ratio column is relative to DDP
    for kind, row in rows.items():
        assert float(row[2]) > 0
        assert float(row[-2]) > 0, f"{kind}: no peak memory"
        assert float(row[-3]) >= 0, f"{kind}: no page-fault count"
        assert float(row[-4]) >= 0 or kind == "local", f"{kind}: no comm cpu"  # (clock rounding: local ~ 0)
    # SGD with momentum keeps one buffer per param; sharded over 2 ranks, half of it per rank
    assert float(rows["fused"][-1]) == float(rows["ddp"][-1]) > 0
    assert abs(float(rows["sharded"][-1]) * 2 - float(rows["fused"][-1])) <= 0.02  # printed to 0.01 MiB
    results = json.loads(out_json.read_text())
    assert set(models_bench.KINDS) <= set(results["models"]["tiny1000"])
    assert (tmp_path / "bench.png").read_bytes().startswith(b"\x89PNG")


def test_kernel_benchmark_prints_ratios_to_a_copy(capsys):
    code = kernels_bench.main(["--reps", "20", "--warmup", "1", "--cases", "100-leaves", "--threads", "1"])
    text = capsys.readouterr().out
    assert code in (0, 1)  # 1 = a target missed; the harness itself worked
    for row in ("flatten", "flatten+scale", "flatten+scale+bf16", "unflatten (fresh)", "unflatten (out=)"):
        assert f" {row} " in text
    assert "x copy" in text
    for row in ("floor: cat of 1-D views", "floor: leaf views"):  # same-run floors, no target
        assert f" {row} " in text and "(floor, no target)" in text


def test_optim_benchmark_prints_each_kind_with_its_ratio_and_checks_the_numbers(capsys):
    from fdp.bench import optim as optim_bench

    code = optim_bench.main(["--steps", "3", "--warmup", "1", "--trees", "10-leaves"])
    text = capsys.readouterr().out
    assert code in (0, 1)  # 1 = the target missed; the harness itself worked
    shown = {*optim_bench.SHOWN, "fused-kernels"}
    rows = {line.split()[1]: line.split() for line in text.splitlines() if line.startswith("10-leaves ")
            and line.split()[1] in shown}
    assert set(rows) == shown, text
    assert float(rows["torch.optim"][3]) == 1.0
    assert "fdp-donate == torch.optim bit for bit: True" in text, text


def test_predict_prints_ddp_and_chosen_caps_per_world_and_link(tmp_path, capsys):
    from fdp.bench import predict as predict_bench

    out_json = tmp_path / "predict.json"
    code = predict_bench.main(["--models", "tiny1000", "--world", "8,512", "--link", "25Gbit,400Gbit",
                               "--steps", "1", "--json", str(out_json), "--plot", str(tmp_path / "p.png")])
    assert code == 0
    rows = json.loads(out_json.read_text())["rows"]
    assert [(r["link"], r["world"]) for r in rows] == [("25Gbit", 8), ("25Gbit", 512), ("400Gbit", 8),
                                                      ("400Gbit", 512)]
    for r in rows:
        assert 0 < r["ddp_eff"] <= 1 and 0 < r["fdp_eff"] <= 1
        assert r["fdp_ms"] <= r["ddp_ms"] + 1e-9, "the chosen caps are never predicted slower than DDP's"
    by = {(r["link"], r["world"]): r for r in rows}
    assert by[("25Gbit", 512)]["ddp_ms"] > by[("25Gbit", 8)]["ddp_ms"]  # more ranks, more latency
    assert by[("400Gbit", 8)]["ddp_ms"] <= by[("25Gbit", 8)]["ddp_ms"]
    assert "tiny1000" in capsys.readouterr().out
    assert (tmp_path / "p.png").read_bytes().startswith(b"\x89PNG")


def test_validate_prints_measured_and_predicted_per_cap_with_the_contention(tmp_path, capsys):
    from fdp.bench import validate as validate_bench

    out_json = tmp_path / "v.json"
    code = validate_bench.main(["--models", "tiny1000", "--worlds", "2", "--steps", "1", "--warmup", "0",
                                "--json", str(out_json)])
    assert code == 0
    r = json.loads(out_json.read_text())["results"]["2"]["tiny1000"]
    # every cap of the sweep, "auto" and the calibration plan; the deferred steps only feed the profile
    assert list(r["rows"]) == ["0.25", "1", "4", "25", "100", "auto", "calibration"]
    for row in r["rows"].values():
        assert row["measured_ms"] > 0 and row["predicted_ms"] > 0
        assert row["error"] == row["predicted_ms"] / row["measured_ms"] - 1
    assert r["contention_ms_per_mib"] >= 0 and r["gbit_s"] > 0
    out = capsys.readouterr().out
    assert "ms lost per MiB beside it" in out and "median |error|" in out


def test_model_benchmark_runs_muon_with_adamw_beside_torch_optim_muon(capsys):
    code = models_bench.main(["--models", "tiny1000", "--steps", "2", "--warmup", "1", "--optim", "muon",
                              "--kinds", "local,ddp,fused,sharded"])
    text = capsys.readouterr().out
    assert code == 0
    rows = {line.split()[1]: line.split() for line in text.splitlines() if line.startswith("tiny1000")}
    assert {"ddp", "fused", "sharded"} <= set(rows), text
    # Muon keeps one momentum buffer per matrix, AdamW two per other param: the same state as torch's
    assert float(rows["fused"][-1]) == float(rows["ddp"][-1]) > 0, text


def test_sharded_benchmark_prints_memory_and_time_of_every_kind(capsys):
    from fdp.bench import sharded

    code = sharded.main(["--width", "32", "--layers", "2", "--mem-width", "32", "--mem-layers", "2", "--steps", "2",
                         "--warmup", "1", "--mem-steps", "1", "--batch", "1"])
    text = capsys.readouterr().out
    assert code == 0
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.startswith("  ") and line.split()}
    for kind in sharded.KINDS:
        assert kind in rows, text
    assert "bound" in text and "all-gather wait" in text, text
    # the same params as DDP's after the run, bit for bit (two ranks, no clipping)
    lines = text.splitlines()
    timed = [line.split() for line in lines[lines.index(next(ln for ln in lines if ln.startswith("time:"))):]
             if line.startswith(("  zero2 ", "  zero3 ", "  fsdp2 "))]
    assert len(timed) == 3, text
    for row in timed:
        a, b = row[-1].split("/")
        assert a == b, row
