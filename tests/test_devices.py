import subprocess
import sys
import textwrap
import types

import pytest

from tutorial_lib import devices


@pytest.mark.parametrize(
    "name, expected",
    [
        ("gpu:1", "/device:GPU:1"),
        ("/gpu:1", "/device:GPU:1"),
        ("GPU:1", "/device:GPU:1"),
        ("/GPU:01", "/device:GPU:1"),
        ("/device:GPU:1", "/device:GPU:1"),
        ("device:gpu:3", "/device:GPU:3"),
        ("/job:localhost/replica:0/task:0/device:GPU:1", "/device:GPU:1"),
        ("/job:localhost/device:GPU:1", "/device:GPU:1"),
        ("/cpu:0", "/device:CPU:0"),
        (" cpu:2 ", "/device:CPU:2"),
    ],
)
def test_normalize_accepts_every_common_form(name, expected):
    assert devices.normalize(name) == expected


@pytest.mark.parametrize(
    "name, expected",
    [
        ("/job:worker/replica:0/task:1/device:CPU:0", "/job:worker/replica:0/task:1/device:CPU:0"),
        ("/job:worker/task:1/cpu:0", "/job:worker/replica:0/task:1/device:CPU:0"),
        ("/job:worker/task:2/device:CPU:0", "/job:worker/replica:0/task:2/device:CPU:0"),
        ("/job:worker/device:cpu:0", "/job:worker/replica:0/task:0/device:CPU:0"),
        ("/job:localhost/replica:0/task:1/device:CPU:0", "/job:localhost/replica:0/task:1/device:CPU:0"),
    ],
)
def test_normalize_keeps_the_job_and_task_of_another_process(name, expected):
    assert devices.normalize(name) == expected


def test_two_core_devices_stay_two_devices():
    names = [f"/job:worker/replica:0/task:{k}/device:CPU:0" for k in range(2)]
    assert len({devices.normalize(n) for n in names}) == 2


def test_normalize_explains_the_seed_bug():
    bad = "/gpu:{}".format("/device:GPU:0")
    with pytest.raises(ValueError, match="formatted into another"):
        devices.normalize(bad)


@pytest.mark.parametrize("junk", ["", "gpu", "/gpu:", "/gpu:x", "foo:1", "/device:GPU:-1", "GPU 0"])
def test_normalize_rejects_junk(junk):
    with pytest.raises(ValueError, match="is not a device name"):
        devices.normalize(junk)


def test_normalize_rejects_non_strings():
    with pytest.raises(TypeError):
        devices.normalize(0)


@pytest.mark.parametrize("n", [0, -1, 1.5, True, "2"])
def test_plan_rejects_bad_counts(n):
    with pytest.raises(ValueError, match="number of devices n must be a whole number >= 1"):
        devices.plan(n)


def test_plan_accepts_numpy_counts():
    import numpy as np

    layout = devices.plan(np.int64(3))
    assert layout.n == 3 and type(layout.n) is int


def test_plan_rejects_unknown_kind():
    with pytest.raises(ValueError, match="kind must be one of"):
        devices.plan(2, kind="tpu")


def test_plan_without_gpu_simulates_cpus():
    layout = devices.plan(4, physical_gpus=0)
    assert (layout.device_type, layout.nccl_ok, layout.model) == ("CPU", False, "logical")
    assert "logical devices in this process" in str(layout)


def test_plan_splits_one_gpu_and_marks_nccl_unusable():
    layout = devices.plan(4, physical_gpus=1)
    assert (layout.device_type, layout.nccl_ok, layout.model) == ("GPU", False, "logical")
    assert "Duplicate GPU" in layout.reason


def test_plan_uses_real_gpus_when_there_are_enough():
    for gpus in (2, 8):
        layout = devices.plan(2, physical_gpus=gpus)
        assert (layout.device_type, layout.nccl_ok, layout.model) == ("GPU", True, "real")
        assert layout.per_gpu == ()


def test_plan_carves_one_gpu_into_n():
    layout = devices.plan(4, physical_gpus=1)
    assert layout.per_gpu == (4,)
    assert "1 GPU for 4 devices" in layout.reason and "NCCL needs 2 or more GPUs" in layout.reason


@pytest.mark.parametrize(
    "n, gpus, per_gpu", [(4, 2, (2, 2)), (5, 2, (3, 2)), (4, 3, (2, 1, 1)), (8, 7, (2,) + (1,) * 6)]
)
def test_plan_spreads_over_every_gpu_when_there_are_too_few(n, gpus, per_gpu):
    """The asker's machine: 4 devices on 2 GPUs use both GPUs, not GPU 0 alone."""
    layout = devices.plan(n, physical_gpus=gpus)
    assert (layout.device_type, layout.nccl_ok, layout.model) == ("GPU", False, "logical")
    assert layout.per_gpu == per_gpu and sum(layout.per_gpu) == n
    # what was chosen, why NCCL is off, and what to ask for instead
    assert f"spread over the {gpus} GPUs ({' + '.join(map(str, per_gpu))})" in layout.reason
    assert "Duplicate GPU detected" in layout.reason and "may hang" in layout.reason
    assert f"call simulate({gpus}) instead" in layout.reason
    assert layout.reason in str(layout)


class _FakeConfig:
    """Records what `devices._configure` asks of `tf.config`, for GPU layouts on a machine without GPUs."""

    def __init__(self, gpus):
        self.gpus, self.visible, self.logical = [f"gpu{i}" for i in range(gpus)], None, {}

    def list_physical_devices(self, kind):
        return self.gpus if kind == "GPU" else ["cpu0"]

    def set_visible_devices(self, devs, kind):
        assert kind == "GPU"
        self.visible = list(devs)

    def set_logical_device_configuration(self, device, configs):
        self.logical[device] = [c.memory_limit for c in configs]

    @staticmethod
    def LogicalDeviceConfiguration(memory_limit=None):  # noqa: N802 (TensorFlow's name)
        return types.SimpleNamespace(memory_limit=memory_limit)


@pytest.mark.parametrize("gpus, n", [(2, 4), (3, 4), (1, 3), (4, 2)])
def test_configure_makes_the_planned_logical_gpus(gpus, n):
    config = _FakeConfig(gpus)
    layout = devices.plan(n, physical_gpus=gpus)
    devices._configure(types.SimpleNamespace(config=config), layout)
    if layout.model == "real":
        assert config.visible == config.gpus[:n] and config.logical == {}
    else:
        assert config.visible == config.gpus  # every GPU is used
        assert [len(config.logical[g]) for g in config.gpus] == list(layout.per_gpu)
        assert {m for limits in config.logical.values() for m in limits} == {devices.GPU_MEMORY_MB}


@pytest.mark.usefixtures("devs")
def test_environment_variable_forces_cpu_simulation():
    import os

    assert os.environ[devices.ENV_VAR] == "cpu"  # set by the root conftest.py
    assert devices.current().device_type == "CPU" and "asked for" in devices.current().reason
    assert devices.current().model == "logical"


def test_gpu_kind_without_gpu_is_an_error():
    with pytest.raises(RuntimeError, match="no GPU"):
        devices.plan(2, kind="gpu", physical_gpus=0)


def test_simulate_gives_n_devices_and_is_idempotent(devs, capsys):
    from tests.conftest import N_DEVICES

    assert devs == [f"/device:CPU:{i}" for i in range(N_DEVICES)]
    assert devices.simulate(N_DEVICES) == devs
    assert "logical CPU" in capsys.readouterr().out
    assert devices.current().n == N_DEVICES


def test_simulate_refuses_another_layout_once_started(devs):
    with pytest.raises(RuntimeError, match="Restart the kernel"):
        devices.simulate(len(devs) + 1)


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


def test_simulate_in_a_fresh_process_gives_each_device_one_intra_op_thread(devs):
    import tensorflow as tf

    # tests/conftest.py called simulate(4) in this process before TensorFlow started
    assert devs == [f"/device:CPU:{i}" for i in range(4)]
    assert tf.config.threading.get_intra_op_parallelism_threads() == 1
    assert tf.config.threading.get_inter_op_parallelism_threads() >= 4


@pytest.mark.slow
def test_simulate_after_tensorflow_started_says_the_threads_were_not_set_and_refuses_another_count():
    result = _run("""
        import tensorflow as tf
        tf.constant(1.0) + 1  # the runtime starts here, with one CPU device and default threads
        from tutorial_lib import devices
        devices.simulate(1)  # the same count: accepted, but nothing could be configured
        devices.simulate(3)
    """)
    assert result.returncode != 0 and "Restart the kernel" in result.stderr
    (line,) = [line for line in result.stdout.splitlines() if "logical CPU device(s)" in line]
    assert "intra-op threads 1 each" not in line
    assert "intra-op threads could not be set, TensorFlow had already started" in line
    assert "TensorFlow's default, one per core in force" in line


def test_bytes_per_device(devs):
    import tensorflow as tf

    with tf.device(devs[1]):
        a = tf.Variable(tf.zeros([10, 10]))
    with tf.device(devs[2]):
        b = tf.Variable(tf.zeros([3], tf.float64))
    assert devices.bytes_per_device([a, b]) == {devs[1]: 400, devs[2]: 24}


def test_simulate_announces_the_spread_and_what_to_ask_for(capsys):
    """What `simulate` prints on the asker's machine (2 GPUs, 4 devices), from the layout it would start."""
    import dataclasses

    layout = devices.plan(4, physical_gpus=2)
    names = tuple(f"/device:GPU:{i}" for i in range(4))
    devices._announce(dataclasses.replace(layout, names=names))
    out = capsys.readouterr().out
    assert out.startswith("4 logical GPU device(s) (2 GPUs for 4 devices: 4 logical GPUs spread over the 2 GPUs")
    assert "call simulate(2) instead" in out and out.rstrip().endswith(", ".join(names))


def test_simulate_says_in_its_line_that_core_devices_share_cores_and_warns_nothing(monkeypatch, capsys, recwarn):
    """3 core devices on 2 cores: the note is in the one line simulate prints, not a warning on stderr
    (which a notebook shows as a red block under its first cell)."""

    def fake_start(n):  # what core_devices.start does before any process: choose the cores, warning
        cores = devices.core_devices.cores_for(n, [0, 1])
        workers = [types.SimpleNamespace(core=core) for core in cores]
        monkeypatch.setattr(devices.core_devices, "workers", workers)
        return [devices.core_devices.device_name(task) for task in range(n)]

    monkeypatch.setattr(devices, "_current", None)
    monkeypatch.setattr(devices.core_devices, "start", fake_start)
    names = devices.simulate(3, kind="cores")
    line = capsys.readouterr().out
    assert len(names) == 3 and line.count("\n") == 1
    assert "pinned to core(s) [0, 1]; 3 devices share 2 core(s), so speed figures no longer mean one core" in line
    assert not [w for w in recwarn.list if "share a core" in str(w.message)]
    with pytest.warns(UserWarning, match="several devices share a core"):  # called directly, it still warns
        devices.core_devices.cores_for(3, [0, 1])
