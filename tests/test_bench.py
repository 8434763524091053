import pytest

from tutorial_lib import bench


def test_cli_runs_a_case_and_writes_json(tmp_path, capsys, devs):
    import json

    path = tmp_path / "bench.json"
    assert (
        bench.main(["--devices", str(len(devs)), "--cases", "packing,mixed", "--repeats", "3", "--json", str(path)])
        == 0
    )
    out = capsys.readouterr().out
    assert "[packing] running" in out and "packed into one bucket" in out and "mixed precision" in out
    rows = json.loads(path.read_text())["rows"]
    one_by_one, packed = (r for r in rows if r["case"] == "packing")
    assert packed["variant"] == "packed into one bucket"
    assert packed["speedup"] == pytest.approx(one_by_one["ms"] / packed["ms"])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--devices", "0"], "--devices must be >= 1"),
        (["--repeats", "0"], "must be >= 1"),
        (["--cases", "weak,bogus"], "unknown case"),
        (["--json", "/nonexistent-folder/out.json"], "not a writable folder"),
        (["--cases", ","], "names no case"),
        (["--cases", " , ,"], "names no case"),
    ],
)
def test_cli_rejects_bad_options(args, message, capsys):
    with pytest.raises(SystemExit):
        bench.main(args)
    assert message in capsys.readouterr().err


def test_cli_warns_when_devices_outnumber_cores(monkeypatch, capsys, devs):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    bench.main(["--devices", str(len(devs)), "--cases", "mixed"])
    assert "at most 2 run at once" in capsys.readouterr().err


def test_cli_refuses_a_json_folder_before_measuring(tmp_path, monkeypatch, capsys, devs):
    ran = []
    monkeypatch.setitem(bench.CASES, "mixed", lambda devs, **options: ran.append((devs, options)) or [])
    with pytest.raises(SystemExit):
        bench.main(["--devices", str(len(devs)), "--cases", "mixed", "--json", str(tmp_path)])
    assert "is a folder; give a file name in it, such as" in capsys.readouterr().err
    assert ran == []


def test_cli_runs_each_case_once(monkeypatch, capsys, devs):
    ran = []
    monkeypatch.setitem(bench.CASES, "mixed", lambda devs, **options: ran.append((devs, options)) or [])
    assert bench.main(["--devices", str(len(devs)), "--cases", "mixed, mixed,"]) == 0
    assert len(ran) == 1
    assert "[mixed] running" in capsys.readouterr().out
