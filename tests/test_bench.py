import time

import pytest

from tutorial_lib import bench


def test_median_time_measures_the_call():
    calls = []

    def sleepy(seconds):
        calls.append(seconds)
        time.sleep(seconds)

    t = bench.median_time(sleepy, 0.01, repeats=3, warmup=2)
    assert len(calls) == 5
    assert t >= 0.01


def test_median_time_rejects_bad_counts():
    with pytest.raises(ValueError):
        bench.median_time(lambda: None, repeats=0)


def test_cores_used_is_about_one_for_busy_python_and_zero_for_sleep():
    def spin():
        end = time.perf_counter() + 0.005
        while time.perf_counter() < end:
            pass

    assert 0.3 < bench.cores_used(spin, repeats=20) <= 1.2
    assert bench.cores_used(time.sleep, 0.005, repeats=10) < 0.5


def test_measure_returns_median_and_spread():
    median, spread = bench.measure(lambda: time.sleep(0.002), repeats=5, warmup=0)
    assert median >= 0.002 and spread >= 0


def test_cli_runs_a_case_and_writes_json(tmp_path, capsys, devs):
    import json

    path = tmp_path / "bench.json"
    assert bench.main(["--devices", str(len(devs)), "--cases", "packing,mixed", "--repeats", "3",
                       "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "[packing] running" in out and "packed into one bucket" in out and "mixed precision" in out
    rows = json.loads(path.read_text())["rows"]
    packed = next(r for r in rows if r["variant"] == "packed into one bucket")
    assert packed["speedup"] > 0 and packed["ms"] > 0


@pytest.mark.parametrize("args, message", [
    (["--devices", "0"], "--devices must be >= 1"),
    (["--repeats", "0"], "must be >= 1"),
    (["--cases", "weak,bogus"], "unknown case"),
    (["--json", "/nonexistent-folder/out.json"], "not a writable folder"),
])
def test_cli_rejects_bad_options(args, message, capsys):
    with pytest.raises(SystemExit):
        bench.main(args)
    assert message in capsys.readouterr().err


def test_cli_warns_when_devices_outnumber_cores(monkeypatch, capsys, devs):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    bench.main(["--devices", str(len(devs)), "--cases", "mixed"])
    assert "at most 2 run at once" in capsys.readouterr().err
