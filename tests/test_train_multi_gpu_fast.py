"""examples/train_multi_gpu.py's speed options: --jit (XLA), --breakdown, --scale-lr / --lr-batch / --warmup."""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf
from test_train_multi_gpu import example  # tests/ is on sys.path

from tutorial_lib.devices import normalize


def _compiled(op):
    """Is `op` a call that XLA must compile (a tf.function(jit_compile=True) called inside another)?"""
    try:
        return op.get_attr("_XlaMustCompile")
    except ValueError:  # an op without the attribute
        return False


def _xla_calls(graph):
    """The devices of the compiled calls in `graph`."""
    return [op.device for op in graph.get_operations() if _compiled(op)]


def _function_ops(graph, device):
    """The op types inside the function that the compiled call on `device` runs."""
    call = next(op for op in graph.get_operations() if _compiled(op) and op.device == device)
    name = call.get_attr("f").name
    function = next(f for f in graph.as_graph_def().library.function if f.signature.name == name)
    return {node.op for node in function.node_def}


@pytest.mark.parametrize(
    "n, extra",
    [
        (3, []),
        (2, ["--bucket-mb", "0.02", "--scale-lr", "linear", "--lr-batch", "12", "--warmup", "2"]),
        pytest.param(2, ["--precision", "float16"], marks=pytest.mark.slow),  # XLA compiles each replica's call: slow
    ],
)
def test_jit_passes_check_against_one_device(devs, n, extra, capsys):
    argv = ["--check", "--steps", "3", "--batch", "24", "--devices", ",".join(devs[:n]), "--jit", "--bn", "local"]
    assert example.main([*argv, *extra]) == 0
    out = capsys.readouterr().out
    assert ", XLA: largest relative difference" in out and "(ok)" in out, out


def test_mirrored_jit_passes_check_and_compiles_one_call_per_replica(devs, monkeypatch, capsys):
    # Two MirroredStrategy objects of one process reuse collective keys: a group of its own for this one.
    monkeypatch.setattr(tf.distribute.MirroredStrategy, "_collective_key_base", 9000)
    runs, real = [], example.trainer
    monkeypatch.setattr(example, "trainer", lambda *a: runs.append(real(*a)) or runs[-1])
    argv = ["--check", "--steps", "3", "--batch", "32", "--devices", ",".join(devs[:2]), "--bn", "local"]
    warmup = ["--scale-lr", "linear", "--lr-batch", "16", "--warmup", "2"]  # the schedule under the strategy too
    assert example.main([*argv, "--strategy", "mirrored", "--jit", *warmup]) == 0
    assert "(ok)" in capsys.readouterr().out
    run = runs[-1]
    x, y = example.load_data("digits")[0]
    batch = next(run.inputs(x.astype(np.float64), y, seed=0))  # --check ran in float64
    graph = run.step.get_concrete_function(*batch).graph
    assert sorted(normalize(d) for d in _xla_calls(graph)) == devs[:2]  # one compiled call per replica


@pytest.mark.parametrize("n", [2, 4])
def test_the_jit_step_compiles_one_call_per_replica_on_its_gpu_and_all_reduces_outside(n):
    from test_placement import GPUS, _batch, _sync_bn

    from tutorial_lib import placement

    replicas, optimizers, owners = _sync_bn(GPUS[:n])
    plan = example.bucket_plan(replicas[0].trainable_variables, 40_000)
    step = example.make_jit_train_step(replicas, GPUS[:n], optimizers, "nccl", bucket_bytes=40_000)
    x, y = _batch(2 * n)
    args = [tf.split(x, n), tf.split(y, n)]
    report = placement.audit(step, *args, owners=owners)  # the compiled calls read their replica's weights
    assert report.ok, report
    graph = step.get_concrete_function(*args).graph
    calls = _xla_calls(graph)
    assert sorted(calls) == [f"/device:GPU:{i}" for i in range(n)], calls  # one compiled call per replica
    nccl = [op.device for op in graph.get_operations() if op.type == "NcclAllReduce"]
    assert sorted(nccl) == sorted(f"/device:GPU:{i}" for i in range(n) for _ in plan)  # one per bucket, outside
    inside = _function_ops(graph, "/device:GPU:1")
    assert "Conv2D" in inside and "Conv2DBackpropFilter" in inside, inside  # forward and backward
    assert not inside & {"NcclAllReduce", "CollectiveReduceV2", "ResourceApplyAdam", "AssignSubVariableOp"}, inside


def test_the_jit_step_runs_with_every_op_and_variable_on_its_replica(devs):
    from test_placement import _batch, _sync_bn

    from tutorial_lib import placement

    replicas, optimizers, owners = _sync_bn(devs[:2])
    step = example.make_jit_train_step(replicas, devs[:2], optimizers, bucket_bytes=40_000)
    x, y = _batch()
    shares = [[tf.identity(t) for t in tf.split(v, 2)] for v in (x, y)]
    report = placement.audit(step, *shares, owners=owners, run=True)
    assert report.ok and report.variables_checked == 60, report


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--jit", "--bn", "sync"], "give --bn local"),
        (["--jit", "--batch", "32", "--simulate", "2"], "--bn auto chose sync: 16 examples a device"),
        (["--breakdown", "--strategy", "mirrored"], "give --strategy replicated"),
        (["--breakdown", "--check"], "drop one"),
        (["--warmup", "10"], "here both 0.001"),
        (["--warmup", "10", "--scale-lr", "linear"], "a --batch other than --lr-batch"),
        (["--warmup", "-1"], "give 0 or more steps"),
        (["--lr-batch", "0"], "the global batch --lr was tuned for"),
        (["--scale-lr", "cubic"], "invalid choice"),
    ],
)
def test_bad_combinations_of_the_new_options_exit_2_with_the_fix(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        example.parse(argv)
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_jit_with_sync_bn_chosen_for_the_machines_devices_exits_2_before_training(devs, monkeypatch, capsys):
    # parse assumes 2 devices (72 a device: local); the machine's 3 GPUs give 24 a device, which auto syncs.
    monkeypatch.setattr(example, "choose_devices", lambda _args: devs[:3])
    monkeypatch.setattr(example, "train", lambda *_a: pytest.fail("trained sync BN under --jit"))
    with pytest.raises(SystemExit) as stop:
        example.main(["--batch", "72", "--jit"])
    assert stop.value.code == 2 and "--bn auto chose sync: 24 examples a device" in capsys.readouterr().err


def test_the_learning_rate_scales_with_the_batch_and_warms_up_from_lr():
    args = example.parse(["--lr", "1e-3", "--batch", "512", "--scale-lr", "linear", "--warmup", "100"])
    assert example.scaled_lr(args) == pytest.approx(4e-3)
    assert example.lr_said(args) == (
        "learning rate: 0.001 tuned for batch 128, scaled linearly to 0.004 for batch 512, warmed up over 100 steps "
        "from 0.001"
    )
    schedule = example.learning_rate(args)
    rates = [float(schedule(step)) for step in (0, 50, 100, 101, 10_000)]
    np.testing.assert_allclose(rates, [1e-3, 2.5e-3, 4e-3, 4e-3, 4e-3], rtol=1e-6)  # Goyal et al.: lr, linear, k lr
    sqrt = example.parse(["--lr", "1e-3", "--batch", "512", "--scale-lr", "sqrt"])
    assert example.learning_rate(sqrt) == pytest.approx(2e-3)  # a float without --warmup: sqrt(512 / 128) = 2
    assert example.learning_rate(example.parse(["--batch", "512"])) == pytest.approx(1e-3)  # none: as given
    half = example.parse(["--batch", "64", "--lr-batch", "256", "--scale-lr", "linear"])
    assert example.learning_rate(half) == pytest.approx(2.5e-4)  # a smaller batch: a smaller rate


def _final(argv, monkeypatch):
    runs, real = [], example.trainer
    keras.utils.set_random_seed(0)  # the same initial weights in each run
    monkeypatch.setattr(example, "trainer", lambda *a: runs.append(real(*a)) or runs[-1])
    assert example.main(argv) == 0
    return runs[-1]


def test_a_run_resumed_inside_its_warmup_goes_on_from_the_saved_step(devs, tmp_path, monkeypatch, capsys):
    argv = ["--batch", "32", "--bn", "local", "--devices", ",".join(devs[:2]), "--scale-lr", "linear", "--lr-batch",
            "8", "--warmup", "4", "--log-every", "1"]  # fmt: skip
    straight = _final([*argv, "--steps", "5"], monkeypatch)
    folder = str(tmp_path / "ckpt")
    _final([*argv, "--steps", "2", "--checkpoint", folder], monkeypatch)  # stops inside the warm-up
    resumed = _final([*argv, "--steps", "5", "--checkpoint", folder], monkeypatch)
    assert "2 steps done" in capsys.readouterr().out
    assert int(resumed.optimizer.iterations) == 5 and float(resumed.optimizer.learning_rate) == pytest.approx(4e-3)
    # Every weight; BN's moving statistics of replica 0 only: with local BN each replica moves its own, and a
    # checkpoint holds replica 0's (a resumed replica 1 starts from them).
    kept = [straight.variables[0], *([v for v in r if v.trainable] for r in straight.variables[1:])]
    again = [resumed.variables[0], *([v for v in r if v.trainable] for r in resumed.variables[1:])]
    for a, b in zip(kept, again, strict=True):
        for u, v in zip(a, b, strict=True):
            np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-5, atol=1e-7)


def test_a_checkpoint_without_a_schedule_resumed_with_a_scaled_rate_trains_at_the_scaled_rate(devs, tmp_path, capsys):
    argv = ["--batch", "32", "--bn", "local", "--devices", ",".join(devs[:2]), "--checkpoint", str(tmp_path / "c")]
    assert example.main([*argv, "--steps", "1"]) == 0
    assert example.main([*argv, "--steps", "2", "--scale-lr", "linear", "--lr-batch", "16"]) == 0
    assert "training on with --lr 0.001 scaled to 0.002" in capsys.readouterr().out


def test_spread_is_the_median_and_half_the_interquartile_range():
    part = example.spread([1.0, 2.0, 3.0, 4.0, 5.0])
    assert part == {"ms": 3.0, "spread": 1.0}  # quartiles 2 and 4


def test_told_apart_gives_a_difference_beyond_the_spreads_and_none_within():
    slow, fast = [9.9, 10.0, 10.1], [7.9, 8.0, 8.1]  # medians 10 and 8, half-IQRs 0.05
    apart = example.told_apart(slow, fast)
    assert apart["ms"] == pytest.approx(2.0) and apart["spread"] == pytest.approx(0.1)
    noisy = [6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0]  # median 9, 1 ms above fast's, half-IQR 1.5
    close = example.told_apart(noisy, fast)
    assert close["ms"] is None and close["difference"] == pytest.approx(1.0) and close["spread"] == pytest.approx(1.55)
    assert example.part_said(close) == "not told apart" and example.part_said(apart).endswith(" ms")
    same = example.told_apart([5.0] * 5, [5.0] * 5)
    assert same["ms"] is None  # no difference at all is not a part of the step
    assert example.told_apart(fast, slow)["ms"] is None  # 2 ms faster with more work: noise, not a part


@pytest.mark.parametrize("jit", [[], ["--jit"]])
def test_breakdown_prints_and_writes_each_part(devs, tmp_path, capsys, jit):
    path = tmp_path / "m.json"
    argv = ["--steps", "2", "--batch", "32", "--bn", "local", "--devices", ",".join(devs[:2]), "--breakdown", *jit]
    assert example.main([*argv, "--json", str(path)]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("breakdown"))
    for name in ("step", "input", "all-reduce", "compute", "input alone"):
        assert f", {name} " in line or f": {name} " in line, line
    parts = json.loads(path.read_text())["breakdown"]
    assert {"step", "input", "all_reduce", "compute", "input_alone", "rounds", "samples_ms"} <= set(parts)
    assert all(len(times) == parts["rounds"] for times in parts["samples_ms"].values())
    for name in ("input", "all_reduce"):  # a number only where told apart
        assert (parts[name]["ms"] is None) == (parts[name]["difference"] <= parts[name]["spread"])
    assert parts["compute"]["ms"] > 0 and parts["step"]["ms"] > 0
