import gc
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
from test_processes import all_dead, env_with_root, kill_leftovers  # tests/ is on sys.path

from tutorial_lib import cluster


def _script(tmp_path, body: str):
    path = tmp_path / "worker.py"
    path.write_text("import json, os, sys, time\n" + body)
    return path


def _gone(c: cluster.Cluster) -> bool:
    for p in c.processes:
        try:
            os.killpg(p.pid, 0)
        except ProcessLookupError:
            continue
        return False
    return True


def test_free_ports_are_distinct_and_bindable():
    ports = cluster.free_ports(4)
    assert len(set(ports)) == 4
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_tf_config_names_every_worker_and_this_task():
    config = cluster.tf_config([1111, 2222], 1)
    assert config == {
        "cluster": {"worker": ["localhost:1111", "localhost:2222"]},
        "task": {"type": "worker", "index": 1},
    }
    with pytest.raises(ValueError, match="outside a cluster of 2"):
        cluster.tf_config([1111, 2222], 2)


def test_each_worker_gets_its_own_tf_config(tmp_path):
    script = _script(tmp_path, "print(json.loads(os.environ['TF_CONFIG'])['task']['index'])\n")
    with cluster.Cluster(script, 3) as c:
        assert c.wait(timeout=30) == [0, 0, 0]
    assert [c.log(i).strip() for i in range(3)] == ["0", "1", "2"]


def test_a_crashing_worker_is_reported_with_its_log_tail_and_the_others_stopped(tmp_path):
    script = _script(
        tmp_path,
        "i = json.loads(os.environ['TF_CONFIG'])['task']['index']\n"
        "print('worker', i, 'up', flush=True)\n"
        "if i == 1: sys.exit(7)\n"
        "time.sleep(60)\n",
    )
    c = cluster.Cluster(script, 2).start()
    start = time.monotonic()
    with pytest.raises(cluster.ClusterError, match=r"worker 1 exited with status 7(.|\n)*worker 1 up"):
        c.wait(timeout=30)
    assert time.monotonic() - start < 20 and c.running() == [] and _gone(c)


@pytest.mark.slow
def test_a_hung_worker_times_out_with_a_clear_error(tmp_path):
    script = _script(tmp_path, "print('waiting for a peer that never comes', flush=True)\ntime.sleep(60)\n")
    c = cluster.Cluster(script, 2).start()
    with pytest.raises(cluster.ClusterError, match=r"still running after 2 s(.|\n)*never comes"):
        c.wait(timeout=2)
    assert c.running() == [] and _gone(c)


def test_bad_input(tmp_path):
    script = _script(tmp_path, "pass\n")
    with pytest.raises(ValueError, match="workers must be a whole number >= 1, got 0"):
        cluster.Cluster(script, 0)
    with pytest.raises(ValueError, match="workers must be a whole number >= 1, got 2.0"):
        cluster.Cluster(script, 2.0)
    with pytest.raises(TypeError, match=r"args must be a list.*write \['--steps', '4'\]"):
        cluster.Cluster(script, 2, args="--steps 4")
    with pytest.raises(FileNotFoundError, match="no training script"):
        cluster.Cluster(tmp_path / "missing.py", 2)


def test_a_numpy_worker_count_is_accepted(tmp_path):
    script = _script(tmp_path, "pass\n")
    with cluster.Cluster(script, np.int64(2)) as c:
        assert c.workers == 2 and c.wait(timeout=30) == [0, 0]


def test_a_stopped_cluster_starts_again(tmp_path):
    script = _script(tmp_path, "print('run', os.environ['RUN'], flush=True)\ntime.sleep(float(os.environ['NAP']))\n")
    c = cluster.Cluster(script, 2, env={"RUN": "1", "NAP": "60"}).start()
    with pytest.raises(cluster.ClusterError, match="already running"):
        c.start()
    c.stop()
    assert c.running() == [] and _gone(c)
    c.env.update(RUN="2", NAP="0")
    c.start()
    assert c.wait(timeout=30) == [0, 0]
    assert [c.log(i).strip() for i in range(2)] == ["run 2", "run 2"]
    c.start()  # and again after a wait
    assert c.wait(timeout=30) == [0, 0]


def test_logs_stay_readable_after_the_with_block_and_go_with_the_cluster(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    script = _script(tmp_path, "print('hello', flush=True)\n")
    with cluster.Cluster(script, 2) as c:
        c.wait(timeout=30)
    assert c.tail(1) == "hello"
    log_dir = c.log_dir
    del c
    gc.collect()
    assert not log_dir.exists()
    assert list((tmp_path / "tmp").iterdir()) == []  # the log root too: nothing left behind


def test_a_new_cluster_removes_the_logs_of_a_killed_driver(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = cluster.log_root() / f"{dead.pid}_abc"
    mine = cluster.log_root() / f"{os.getpid()}_abc"
    for folder in (stale, mine):
        folder.mkdir(parents=True)
        (folder / "worker0.log").write_text("old")
    c = cluster.Cluster(_script(tmp_path, "pass\n"), 1)
    assert not stale.exists() and mine.exists() and c.log_dir.exists()
    c.log_dir.rmdir()  # a folder that is not there is fine at garbage collection
    del c
    gc.collect()


def test_sweep_logs_removes_only_the_folders_of_dead_processes(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    cluster.sweep_logs()  # no root yet: nothing to do, no error
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale, mine, other = (cluster.log_root() / name for name in (f"{dead.pid}_x", f"{os.getpid()}_x", "notes"))
    for folder in (stale, mine, other):
        folder.mkdir(parents=True)
    cluster.sweep_logs()
    assert not stale.exists() and mine.exists() and other.exists()


DRIVER = """
import sys, time
from tutorial_lib import cluster
c = cluster.Cluster(sys.argv[1], 2).start()
print(*(p.pid for p in c.processes), flush=True)
if sys.argv[2] == "returns":
    sys.exit(0)  # without stop()
time.sleep(300)  # until the test's signal
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def _default_signals():
    """In the child: SIGHUP and SIGTERM as a terminal's session would deliver them, whatever the suite inherited."""
    for sig in (signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


@pytest.mark.parametrize(
    "ending",
    ["returns", signal.SIGTERM, signal.SIGHUP, signal.SIGKILL],
    ids=["returns", "SIGTERM", "SIGHUP", "SIGKILL"],
)
def test_workers_die_with_their_driver(tmp_path, ending):
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    worker = _script(tmp_path, "time.sleep(300)\n")
    how = ending if isinstance(ending, str) else "waits"
    process = subprocess.Popen(
        [sys.executable, str(driver), str(worker), how],
        stdout=subprocess.PIPE,
        env=env_with_root(),
        preexec_fn=_default_signals,  # a suite started under nohup would hand the driver an ignored SIGHUP
    )
    pids = [int(pid) for pid in process.stdout.readline().split()]
    try:
        assert len(pids) == 2
        if not isinstance(ending, str):
            process.send_signal(ending)
        process.wait(timeout=60)  # the worker sleeps 300 s: a driver that outlives the signal fails here
        assert all_dead(pids), f"workers {pids} outlived their driver ({ending})"
    finally:
        kill_leftovers(pids)
        process.kill()
        process.wait()
        process.stdout.close()


def test_tail_drops_tensorflow_startup_info_but_keeps_warnings(tmp_path):
    banner = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
    info = "I0000 00:00:1796033744.528282   20364 port.cc:153] oneDNN custom operations are on."
    script = _script(
        tmp_path,
        f"print({banner!r})\n"
        f"print({info!r})\n"
        "print('W0000 00:00:1796033744.5 real warning')\n"
        "print('worker says hello')\n",
    )
    with cluster.Cluster(script, 1) as c:
        c.wait(timeout=30)
    assert c.tail(0).splitlines() == ["W0000 00:00:1796033744.5 real warning", "worker says hello"]
