import json
import os
import socket
import time

import numpy as np
import pytest

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
        assert cluster.port_is_free(port)


def test_tf_config_names_every_worker_and_this_task():
    config = cluster.tf_config([1111, 2222], 1)
    assert config == {"cluster": {"worker": ["localhost:1111", "localhost:2222"]},
                      "task": {"type": "worker", "index": 1}}
    with pytest.raises(ValueError, match="outside a cluster of 2"):
        cluster.tf_config([1111, 2222], 2)


def test_each_worker_gets_its_own_tf_config(tmp_path):
    script = _script(tmp_path, "print(json.loads(os.environ['TF_CONFIG'])['task']['index'])\n")
    with cluster.Cluster(script, 3) as c:
        assert c.wait(timeout=30) == [0, 0, 0]
    assert [c.log(i).strip() for i in range(3)] == ["0", "1", "2"]


def test_a_crashing_worker_is_reported_with_its_log_tail_and_the_others_stopped(tmp_path):
    script = _script(tmp_path, "i = json.loads(os.environ['TF_CONFIG'])['task']['index']\n"
                               "print('worker', i, 'up', flush=True)\n"
                               "if i == 1: sys.exit(7)\n"
                               "time.sleep(60)\n")
    c = cluster.Cluster(script, 2).start()
    start = time.monotonic()
    with pytest.raises(cluster.ClusterError, match=r"worker 1 exited with status 7(.|\n)*worker 1 up"):
        c.wait(timeout=30)
    assert time.monotonic() - start < 20 and c.running() == [] and _gone(c)


def test_a_hung_worker_times_out_with_a_clear_error(tmp_path):
    script = _script(tmp_path, "print('waiting for a peer that never comes', flush=True)\ntime.sleep(60)\n")
    c = cluster.Cluster(script, 2).start()
    with pytest.raises(cluster.ClusterError, match=r"still running after 2 s(.|\n)*never comes"):
        c.wait(timeout=2)
    assert c.running() == [] and _gone(c)


def test_kill_stops_one_worker_like_a_crash(tmp_path):
    script = _script(tmp_path, "time.sleep(60)\n")
    with cluster.Cluster(script, 2) as c:
        c.kill(0)
        assert c.running() == [1]
    assert c.running() == [] and _gone(c)


def test_bad_input(tmp_path):
    script = _script(tmp_path, "pass\n")
    with pytest.raises(ValueError, match="workers >= 1"):
        cluster.Cluster(script, 0)
    with pytest.raises(FileNotFoundError, match="no training script"):
        cluster.Cluster(tmp_path / "missing.py", 2)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        busy = held.getsockname()[1]
        with pytest.raises(cluster.ClusterError, match=f"port.*{busy}.*already in use"):
            cluster.Cluster(script, 2, ports=[busy, cluster.free_ports(1)[0]])
    with pytest.raises(ValueError, match="2 workers need 2 ports"):
        cluster.Cluster(script, 2, ports=[1234])


def test_multi_worker_training_equals_one_process_and_leaves_nothing_running(tmp_path):
    from tutorial_lib import multi_worker

    args = ["--steps", "6", "--checkpoint-every", "3", "--out", str(tmp_path)]
    with cluster.Cluster(["-m", "tutorial_lib.multi_worker"], 2, args=args, env={"TF_CPP_MIN_LOG_LEVEL": "3"}) as c:
        assert c.wait(timeout=180) == [0, 0]
    assert _gone(c)
    weights = np.load(tmp_path / "weights.npz")
    for i, ref in enumerate(multi_worker.reference_weights(2, 32, 6)):
        np.testing.assert_allclose(weights[f"arr_{i}"], ref, rtol=1e-5, atol=1e-6)
    steps = [json.loads(line)["step"] for line in open(tmp_path / "steps.jsonl")]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert not (tmp_path / "checkpoints" / "tmp_worker1").exists()  # the non-chief cleaned up


def test_multi_worker_options_are_checked(tmp_path):
    from tutorial_lib import multi_worker

    with pytest.raises(SystemExit):
        multi_worker.parse(["--steps", "0", "--out", str(tmp_path)])


def test_tail_drops_tensorflow_startup_info_but_keeps_warnings(tmp_path):
    banner = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
    info = "I0000 00:00:1796033744.528282   20364 port.cc:153] oneDNN custom operations are on."
    script = _script(tmp_path, f"print({banner!r})\n"
                               f"print({info!r})\n"
                               "print('W0000 00:00:1796033744.5 real warning')\n"
                               "print('worker says hello')\n")
    with cluster.Cluster(script, 1) as c:
        c.wait(timeout=30)
    assert c.tail(0).splitlines() == ["W0000 00:00:1796033744.5 real warning", "worker says hello"]
