"""Notebook 03 writes its key code in cells; `tutorial_lib` keeps the tested copies.

These tests run the notebook's own cells (their definitions: functions, imports and
assignments, without the prints and loops around them) beside the library, so that an
edit of a cell that changes its result fails here, not only in nbval's comparison of
printed output: the ring's schedule and all-reduce, `allreduce_grads` over the ring and
over NCCL's raw op, and the replicated step that the benchmark times (`bench_scaling.ring_step`).
"""

import ast
import json
import linecache
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from tutorial_lib import allreduce, bench_scaling, devices, models, reference
from tutorial_lib.bench_rows import synthetic_batch

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "03_nccl_allreduce.ipynb"
DEFINITIONS = (ast.FunctionDef, ast.Import, ast.ImportFrom, ast.Assign)


def cell_defining(name: str) -> str:
    """The source of the notebook's code cell that defines function `name`."""
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    found = [c for c in cells if c["cell_type"] == "code" and f"def {name}(" in "".join(c["source"])]
    assert len(found) == 1, f"notebook 03 should define {name} in exactly one cell, found {len(found)}"
    return "".join(found[0]["source"])


def definitions(source: str) -> str:
    """The cell's functions, imports and assignments: what later cells use, without its output."""
    tree = ast.parse(source)
    tree.body = [node for node in tree.body if isinstance(node, DEFINITIONS)]
    return ast.unparse(tree)


def notebook(devs, *names, edit=None, **values) -> dict:
    """A namespace holding the notebook's definitions of `names` (in order), run on `devs`.

    `edit(name, source)` may change a cell's source first: the tests use it to show that a
    wrong edit is caught.
    """
    space = {"tf": tf, "np": np, "models": models, "DEVICES": list(devs), "N": len(devs), **values}
    for name in names:
        source = definitions(cell_defining(name))
        source = edit(name, source) if edit else source
        filename = f"<notebook 03: {name}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # for AutoGraph
        exec(compile(source, filename, "exec"), space)
    return space


def _placed(devs, arrays):
    out = []
    for d, a in zip(devs, arrays, strict=True):
        with tf.device(d):
            out.append(tf.constant(a))
    return out


# --- the ring ----------------------------------------------------------------------------


@pytest.mark.parametrize("n", range(1, 7))
def test_the_notebooks_ring_schedule_is_the_librarys(devs, n):
    space = notebook(devs, "ring_schedule")
    assert space["ring_schedule"](n) == allreduce.ring_schedule(n)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("shape", [(), (7,), (3, 5)])
def test_the_notebooks_ring_executes_its_schedule_and_equals_the_librarys(devs, n, shape):
    space = notebook(devs[:n], "ring_schedule", "ring_all_reduce")
    rng = np.random.default_rng(n)
    tensors = _placed(devs[:n], [rng.normal(size=shape).astype(np.float32) for _ in range(n)])
    mine, theirs = {}, {}
    ours = space["ring_all_reduce"](tensors, devs[:n], stats=mine)
    tested = allreduce.ring_all_reduce(tensors, devices=devs[:n], stats=theirs)
    for a, b in zip(ours, tested, strict=True):
        np.testing.assert_array_equal(a, b)
    assert mine == theirs and mine["sends"] == allreduce.ring_schedule(n)


# --- allreduce_grads ---------------------------------------------------------------------

SHAPES = [(6, 5), (5,), (5, 3), (3,)]


def _tower_grads(devs, seed=0):
    rng = np.random.default_rng(seed)
    return [_placed([d] * len(SHAPES), [rng.normal(size=s).astype(np.float32) for s in SHAPES]) for d in devs]


def _on_their_devices(devs, tower_grads):
    """Inside a tf.function a tensor's device is known only under tf.device: copy each tower's there."""
    placed = []
    for d, tower in zip(devs, tower_grads, strict=True):
        with tf.device(d):
            placed.append([tf.identity(t) for t in tower])
    return placed


def _grads_cells(devs, edit=None):
    return notebook(devs, "ring_schedule", "ring_all_reduce", "nccl_all_sum", "allreduce_grads", edit=edit)


def _assert_same_grads(ours, tested, devs):
    assert len(ours) == len(tested) == len(devs)
    for mine, theirs, d in zip(ours, tested, devs, strict=True):
        for a, b in zip(mine, theirs, strict=True):
            np.testing.assert_array_equal(a, b)
            assert devices.normalize(a.device) == devices.normalize(d)


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("average", [True, False])
def test_the_notebooks_allreduce_grads_equals_the_librarys(devs, k, average):
    grads = _tower_grads(devs[:k])
    ours = _grads_cells(devs)["allreduce_grads"](grads, average=average, method="ring")
    _assert_same_grads(ours, allreduce.allreduce_grads(grads, average=average, method="ring"), devs[:k])


def test_the_notebooks_allreduce_grads_equals_the_librarys_inside_a_tf_function(devs):
    space = _grads_cells(devs)
    grads = _tower_grads(devs)

    @tf.function
    def both(g):
        placed = _on_their_devices(devs, g)
        return space["allreduce_grads"](placed), allreduce.allreduce_grads(placed)

    ours, tested = both(grads)
    for mine, theirs in zip(ours, tested, strict=True):
        for a, b in zip(mine, theirs, strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    ("cell", "old", "new"),
    [
        ("allreduce_grads", "g / k", "g / (k + 1)"),  # a wrong average
        ("allreduce_grads", "zip(*new_all_grads, strict=True)", "reversed(list(zip(*new_all_grads, strict=True)))"),
        ("ring_all_reduce", "chunks[dst][c] + received", "received"),  # reduce-scatter that forgets to add
    ],
)
def test_a_wrong_edit_of_a_cell_is_caught(devs, cell, old, new):
    def edit(name, source):
        if name != cell:
            return source
        assert old in source, f"the notebook's {cell} changed: update this test's edit"
        return source.replace(old, new)

    grads = _tower_grads(devs)
    ours = _grads_cells(devs, edit=edit)["allreduce_grads"](grads)
    with pytest.raises(AssertionError):
        _assert_same_grads(ours, allreduce.allreduce_grads(grads), devs)


def _nccl_ops(fn, *args) -> list:
    """The NcclAllReduce ops that tracing `fn` builds: (shared name, device, num_devices, reduction).

    Traced only, never run: there is no NCCL kernel on CPUs.
    """
    graph = tf.function(fn).get_concrete_function(*args).graph
    found = []
    for op in graph.get_operations():
        if op.type == "NcclAllReduce":
            attrs = op.get_attr("shared_name"), op.get_attr("num_devices"), op.get_attr("reduction")
            found.append((attrs[0].decode(), devices.normalize(op.device), attrs[1], attrs[2].decode()))
    return found


def _one_all_reduce_per_variable(found, devs):
    """Group the NCCL ops by shared name: each group must be one op per tower, on its device."""
    groups = {}
    for name, device, num_devices, reduction in found:
        assert (num_devices, reduction) == (len(devs), "sum")
        groups.setdefault(name, []).append(device)
    return sorted(sorted(g) for g in groups.values())


def test_the_notebooks_nccl_variant_builds_one_raw_nccl_all_reduce_per_variable_and_tower(devs):
    space = _grads_cells(devs)
    grads = _tower_grads(devs)
    found = _nccl_ops(lambda g: space["allreduce_grads"](_on_their_devices(devs, g), method="nccl"), grads)
    expected = [sorted(devices.normalize(d) for d in devs)] * len(SHAPES)
    assert _one_all_reduce_per_variable(found, devs) == expected


def test_the_librarys_nccl_sum_builds_the_same_ops_as_the_notebooks(devs):
    space = _grads_cells(devs)
    tensors = _placed(devs, [np.ones(3, np.float32)] * len(devs))
    ours = _nccl_ops(lambda t: space["nccl_all_sum"](t, devs), tensors)
    tested = _nccl_ops(lambda t: allreduce.nccl_sum(t, devs), tensors)
    assert [op[1:] for op in ours] == [op[1:] for op in tested]
    assert _one_all_reduce_per_variable(tested, devs) == [sorted(devices.normalize(d) for d in devs)]


def test_each_nccl_all_reduce_gets_its_own_shared_name(devs):
    tensors = _placed(devs[:2], [np.ones(3, np.float32)] * 2)
    first, second = (_nccl_ops(lambda t: allreduce.nccl_sum(t, devs[:2]), tensors) for _ in range(2))
    assert {op[0] for op in first}.isdisjoint(op[0] for op in second)


# --- the replicated step against the benchmark's ----------------------------------------

LR = bench_scaling.LEARNING_RATE  # the notebook's step, run at the benchmark's learning rate


def _replicas(devs, hidden=(8,)):
    out = []
    for d in devs:
        with tf.device(d):
            out.append(models.MLP(hidden=hidden, seed=0))
    return out


def _weights(net):
    return [v.numpy() for v in net.trainable_variables]


@pytest.mark.parametrize("k", [2, 4])
def test_the_notebooks_replicated_step_equals_the_benchmarks_ring_step_and_one_device(devs, k):
    x, y = synthetic_batch(8 * k)
    cells = ("ring_schedule", "ring_all_reduce", "nccl_all_sum", "allreduce_grads", "make_replicated_step")
    space = notebook(devs[:k], *cells, LR=LR)
    space["replicas"] = _replicas(devs[:k])  # the cell builds its own in a loop, which is left out
    loss = space["make_replicated_step"]("ring")(x, y)

    bench_replicas = _replicas(devs[:k])
    bench_losses = bench_scaling.ring_step(bench_replicas, devs[:k])(x, y)
    single = models.MLP(hidden=(8,), seed=0)
    expected = reference.sgd_step(single, x, y, LR)

    np.testing.assert_allclose(float(loss), np.mean([float(v) for v in bench_losses]), rtol=1e-6)
    np.testing.assert_allclose(float(loss), float(expected), rtol=1e-5)
    for mine, theirs in zip(space["replicas"], bench_replicas, strict=True):
        for a, b, r in zip(_weights(mine), _weights(theirs), _weights(single), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
            np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-6)


def test_definitions_leave_out_output_and_loops():
    source = "import os\nx = 1\nprint(x)\nfor i in range(3):\n    x += i\n\n\ndef f():\n    return x\n"
    kept = definitions(source)
    assert "print" not in kept and "for i" not in kept
    space = {}
    exec(kept, space)
    assert space["f"]() == 1 and "os" in space


def test_cell_defining_names_the_missing_function():
    with pytest.raises(AssertionError, match="no_such_function"):
        cell_defining("no_such_function")


# --- section 6: which errors mean "not available here" ------------------------------------


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("No OpKernel was registered to support Op 'NcclAllReduce' used by {{node NcclAllReduce}}", True),
        ("Op type not registered 'NcclAllReduce' in binary running on host.", True),
        ("NCCL WARN Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1000", False),
        ("Incompatible shapes: [4] vs. [5]", False),
    ],
)
def test_only_a_missing_kernel_or_op_counts_as_not_available(devs, message, expected):
    space = notebook(devs, "not_available_here", train_reference=lambda **_: None)  # the cell trains one
    not_available_here = space["not_available_here"]
    assert not_available_here(tf.errors.InvalidArgumentError(None, None, message)) is expected
