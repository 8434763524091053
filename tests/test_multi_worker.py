"""The multi-worker training script on its own: one process, no `TF_CONFIG`."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from tutorial_lib import multi_worker

ROOT = Path(__file__).resolve().parents[1]


def run_script(*args):
    """`python -m tutorial_lib.multi_worker ARGS` without TF_CONFIG: a one-worker job."""
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    env.update(PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.run(
        [sys.executable, "-m", "tutorial_lib.multi_worker", *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def resolver(task_type, task_id, jobs=("worker",)):
    return SimpleNamespace(task_type=task_type, task_id=task_id, cluster_spec=lambda: SimpleNamespace(jobs=list(jobs)))


@pytest.mark.parametrize(
    "task_type, task_id, jobs, chief",
    [
        (None, None, (), True),  # no TF_CONFIG: a one-worker job
        ("worker", 0, ("worker",), True),
        ("worker", 1, ("worker",), False),
        ("chief", 0, ("chief", "worker"), True),
        ("worker", 0, ("chief", "worker"), False),  # the cluster has a chief of its own
    ],
)
def test_is_chief(task_type, task_id, jobs, chief):
    assert multi_worker.is_chief(resolver(task_type, task_id, jobs)) is chief


def test_checkpoint_dir_is_the_real_one_for_the_chief_only():
    assert multi_worker.checkpoint_dir("ck", resolver(None, None, ())) == "ck"
    assert multi_worker.checkpoint_dir("ck", resolver("worker", 0)) == "ck"
    assert multi_worker.checkpoint_dir("ck", resolver("worker", 2)) == os.path.join("ck", "tmp_worker2")


@pytest.mark.slow
def test_a_run_without_tf_config_writes_its_outputs_and_a_rerun_says_it_is_complete(tmp_path):
    first = run_script("--steps", 4, "--checkpoint-every", 2, "--out", tmp_path)
    assert first.returncode == 0, first.stderr
    assert "worker 0: done at step 4" in first.stdout
    log = (tmp_path / "steps.jsonl").read_text()
    assert [json.loads(line)["step"] for line in log.splitlines()] == [1, 2, 3, 4]
    assert (tmp_path / "checkpoints" / "ckpt-4.index").exists()
    weights = np.load(tmp_path / "weights.npz")
    for i, ref in enumerate(multi_worker.reference_weights(1, 32, 4)):
        np.testing.assert_allclose(weights[f"arr_{i}"], ref, rtol=1e-5, atol=1e-6)

    again = run_script("--steps", 4, "--out", tmp_path)
    assert again.returncode == 0, again.stderr
    assert "the job is complete (checkpoint at step 4, --steps 4)" in again.stdout
    assert (tmp_path / "steps.jsonl").read_text() == log  # nothing trained twice


@pytest.mark.parametrize(
    "tf_config, message",
    [
        (None, "--crash-worker 1 is not a worker of this 1-worker job; give a worker index from 0 to 0"),
        (
            '{"cluster": {"worker": ["localhost:1", "localhost:2"]}, "task": {"type": "worker", "index": 0}}',
            "--crash-worker 2 is not a worker of this 2-worker job; give a worker index from 0 to 1",
        ),
    ],
)
def test_a_crash_worker_outside_the_job_is_refused_before_anything_starts(
    tmp_path, monkeypatch, capsys, tf_config, message
):
    if tf_config is None:
        monkeypatch.delenv("TF_CONFIG", raising=False)
    else:
        monkeypatch.setenv("TF_CONFIG", tf_config)
    crash_worker = "1" if tf_config is None else "2"
    with pytest.raises(SystemExit) as stopped:
        multi_worker.parse(["--crash-at", "2", "--crash-worker", crash_worker, "--out", str(tmp_path / "out")])
    assert stopped.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_options_are_checked(tmp_path, capsys):
    with pytest.raises(SystemExit):
        multi_worker.parse(["--steps", "0", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        multi_worker.parse(["--crash-worker", "-1", "--out", str(tmp_path)])
    assert "--crash-worker must be a worker index >= 0 (0 is the chief), got -1" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("tf_config", "message"),
    [
        ("not json", "TF_CONFIG is not a cluster and a task (JSONDecodeError"),
        (
            '{"cluster": {"worker": ["localhost:1"]}, "task": {"type": "worker", "index": 3}}',
            "TF_CONFIG's task index 3 is outside its 1 'worker' task(s): give an index from 0 to 0",
        ),
    ],
)
def test_a_bad_tf_config_exits_2_naming_it_and_the_fix(tmp_path, monkeypatch, capsys, tf_config, message):
    monkeypatch.setenv("TF_CONFIG", tf_config)
    with pytest.raises(SystemExit) as stopped:
        multi_worker.parse(["--out", str(tmp_path / "out")])
    assert stopped.value.code == 2 and message in capsys.readouterr().err


def test_out_naming_a_file_exits_2(tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(SystemExit) as stopped:
        multi_worker.parse(["--out", str(tmp_path / "a_file")])
    assert stopped.value.code == 2 and "is a file, not a folder" in capsys.readouterr().err
