"""The MultiWorkerMirroredStrategy peer of the bench: its launcher, with the cluster faked.

The workers themselves run in tests/test_bench.py::test_cli_on_core_devices_by_default.
"""

import os

import pytest

from tutorial_lib import cluster, timing
from tutorial_lib.bench import rows, worker


class FakeCluster:
    """Stands in for cluster.Cluster: records how it was made, "runs" nothing, shows a chief log."""

    made = []
    chief_log = ""

    def __init__(self, script, workers, args=(), env=None):
        self.made.append({"script": script, "workers": workers, "args": [str(a) for a in args], "env": env})

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def wait(self, timeout):
        assert timeout > 0

    def log(self, index):
        assert index == 0  # the chief reports
        return self.chief_log

    def tail(self, index):
        assert index == 0
        return self.chief_log[-200:]


@pytest.fixture
def fake_cluster(monkeypatch):
    FakeCluster.made = []
    monkeypatch.setattr(cluster, "Cluster", FakeCluster)
    return FakeCluster


def test_the_chiefs_timings_come_back_per_per_device_batch(fake_cluster):
    fake_cluster.chief_log = 'starting\nMWMS_TIMINGS {"64": [0.01, 0.002, 5], "256": [0.03, 0.004, 5]}\n'
    result = worker.time_mwms(2, (16, 16), (64, 256), rounds=5)
    assert result == {64: timing.Timing(0.01, 0.002, 5), 256: timing.Timing(0.03, 0.004, 5)}
    (made,) = fake_cluster.made
    assert made["script"] == ["-m", "tutorial_lib.bench.worker"] and made["workers"] == 2
    args = made["args"]
    assert args[args.index("--per-device") + 1] == "64,256" and args[args.index("--hidden") + 1] == "16,16"
    assert args[args.index("--rounds") + 1] == "5"
    assert made["env"]["CUDA_VISIBLE_DEVICES"] == ""  # a core device is a CPU
    assert made["env"]["PYTHONPATH"].split(os.pathsep)[0] == str(worker._ROOT)  # this checkout's package
    assert (worker._ROOT / "tutorial_lib" / "bench" / "worker.py").exists()


def test_a_chief_that_prints_no_timings_is_a_clear_error(fake_cluster):
    fake_cluster.chief_log = "Traceback: something went wrong\n"
    with pytest.raises(RuntimeError, match="finished without printing its timings(.|\n)*something went wrong"):
        worker.time_mwms(2, (16,), (64,), rounds=3)


def test_the_peer_rows_hold_the_hand_towers_speedup_over_the_strategy(monkeypatch):
    monkeypatch.setattr(worker, "time_mwms", lambda *_, **__: {64: timing.Timing(0.004, 0.0, 5)})
    hand = rows.row("weak scaling", "hand towers", timing.Timing(0.002, 0.0, 5), devices=2, per_device=64)
    (peer,) = worker.peer_rows([hand], ["a", "b"], (16,), (64,), repeats=5)
    assert (peer["variant"], peer["ms"], peer["samples"], peer["per_device"]) == (
        "MultiWorkerMirroredStrategy",
        4.0,
        5,
        64,
    )
    assert peer["hand_towers_speedup"] == 2.0 and peer["hand_towers_speedup_verdict"] == "faster"


def test_each_worker_takes_its_core_from_its_task_index(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["a", "b"]}, "task": {"type": "worker", "index": 1}}')
    assert worker._task_index() == 1
    monkeypatch.delenv("TF_CONFIG")
    assert worker._task_index() == 0
    args = worker._arguments(["--cores", "3,5", "--hidden", "8", "--per-device", "4,16"])
    assert (args.cores, args.hidden, args.per_device) == ([3, 5], [8], [4, 16])
