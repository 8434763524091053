"""The pipeline's guard rails, beside the step, never inside it: what `Pipeline` refuses when it
is made (`check_stages`) and once per new batch shape (`check_split`, `check_labels`, `dry_run`,
`refuse_random`).
"""

from __future__ import annotations

import keras
import numpy as np
import pipeline_checks as take_away_checks  # examples/pipeline_checks.py: the op types that draw random numbers
import tensorflow as tf
from pipeline_parallel import run_stage

from . import models


def check_stages(stages, devices, learning_rate, optimizer, recompute=False) -> None:
    """Refuse stages, devices and an update rule that the pipeline cannot run as one device would."""
    if not stages or len(stages) != len(devices):
        raise ValueError(f"need one device per stage, got {len(stages)} stages and {len(devices)} devices.")
    if (learning_rate is None) == (optimizer is None):
        raise ValueError(
            "give either learning_rate (plain SGD) or optimizer (a Keras optimizer, copied once per stage), "
            "not both and not neither."
        )
    for s, stage in enumerate(stages):
        refuse_layers(s, stage)
    if recompute:
        refuse_state(stages)
    if optimizer is not None:
        check_optimizer(optimizer)
        refuse_shared_variables(stages)


def keras_layers(stage) -> list:
    """Every Keras layer in `stage`: itself and those held in its attributes, lists and dicts."""
    found, seen, todo = [], set(), [stage]
    while todo:
        obj = todo.pop(0)
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        found += [obj] if isinstance(obj, keras.Layer) else []
        if isinstance(obj, keras.Layer | tf.Module):
            todo += list(vars(obj).values())
        elif isinstance(obj, list | tuple | dict):
            todo += list(obj.values() if isinstance(obj, dict) else obj)
    return found


def refuse_layers(s: int, stage) -> None:
    """Keras layers inside a `tf.Module` stage, which cannot be told that it trains (they would run
    in inference mode, silently), and batch norm, which would see micro-batches, not the batch."""
    layers = keras_layers(stage)
    if layers and not isinstance(stage, keras.Layer):
        raise ValueError(
            f"stage {s} is a {type(stage).__name__} that holds the Keras layer {layers[0].name!r}: a tf.Module "
            "cannot be called with training=True, so its Keras layers would run in inference mode (Dropout drops "
            "nothing). Make the stage a Keras model, such as keras.Sequential([...]), or keep Keras layers out of it."
        )
    for layer in layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            raise ValueError(
                f"stage {s} has the BatchNormalization layer {layer.name!r}: it would normalize each micro-batch "
                "alone and update its moving averages M times a step. Use keras.layers.LayerNormalization or "
                "GroupNormalization, or data parallelism with synchronized batch norm (notebook 04)."
            )


def refuse_state(chunks) -> None:
    """Recomputation runs each forward twice: refuse layers whose forward changes state."""
    for k, chunk in enumerate(chunks):
        trainable = {id(v) for v in getattr(chunk, "trainable_variables", ())}
        state = [v for v in getattr(chunk, "variables", ()) if id(v) not in trainable]
        if state:
            name = getattr(state[0], "path", getattr(state[0], "name", "?"))
            raise ValueError(
                f"chunk {k} holds the non-trainable variable {name!r} (a Dropout seed or moving statistics): "
                "recompute=True would run its forward twice and change that state twice, so the backward would "
                "not match the forward. Use recompute=False, or layers without state."
            )


def refuse_random(chunks, devices, x, micro_batches) -> None:
    """Recomputation runs each forward twice: refuse a chunk whose forward draws random numbers from TensorFlow's
    random ops without a variable (tf.random.uniform in a Lambda layer, a tf.random.Generator), which refuse_state
    cannot see: the rerun would draw other numbers, and the gradient would not be the forward's. The take-away's
    pipeline_checks.RANDOM_OPS names them; each chunk's forward is traced on a micro-batch, function bodies
    entered."""
    h = _sample(x, x.shape[0] // micro_batches)
    for k, (chunk, device) in enumerate(zip(chunks, devices, strict=True)):
        with tf.device(device):
            spec = tf.TensorSpec(h.shape, h.dtype)
            graph = tf.function(lambda a, c=chunk: run_stage(c, a)).get_concrete_function(spec).graph.as_graph_def()
            h = chunk(h)
        ops = [n.op for n in graph.node] + [n.op for f in graph.library.function for n in f.node_def]
        if drawn := sorted({op for op in ops if take_away_checks.RANDOM_OPS.search(op)}):
            raise ValueError(
                f"chunk {k} draws random numbers in its forward ({', '.join(drawn)}): recompute=True would run it "
                "twice, and the rerun would draw other numbers than the forward that made the loss, so the "
                "backward would not be its gradient. Use recompute=False, or draw the numbers outside the chunk."
            )


def check_optimizer(optimizer) -> None:
    """Refuse what one copy of the optimizer per stage cannot do as one optimizer would."""
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            f"optimizer must be a Keras optimizer such as keras.optimizers.Adam(1e-3), got {type(optimizer).__name__}; "
            "for plain SGD pass learning_rate instead."
        )
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) or optimizer.loss_scale_factor is not None:
        raise ValueError(
            "loss scaling is not supported: the pipeline does not scale the loss, and each stage's copy would check "
            "only its own gradients for overflow and could skip its update while the other stages apply theirs."
        )
    if optimizer.global_clipnorm:
        raise ValueError(
            "global_clipnorm is not supported: each stage's copy of the optimizer sees only its own stage's "
            "gradients, so it would clip by the norm of one stage; use clipnorm or clipvalue (per weight)."
        )
    if optimizer.built:
        raise ValueError(
            "this optimizer is already built on some variables, and its state would not carry over to the copies "
            "the pipeline makes, one per stage: pass a new one, e.g. keras.optimizers.Adam(1e-3)."
        )


def refuse_shared_variables(stages) -> None:
    """Refuse a variable in two stages: two optimizer copies would update it twice, with two states."""
    owner = {}  # id of a variable -> the first stage that has it (its stage keeps it alive)
    for s, stage in enumerate(stages):
        for v in stage.trainable_variables:
            first = owner.setdefault(id(v), s)
            if first != s:
                raise ValueError(
                    f"the variable {v.name!r} belongs to stages {first} and {s}: with an optimizer per stage it would "
                    "be updated twice per step, with two states. Give each stage its own variables, or use "
                    "learning_rate (plain SGD adds the two updates, as one device does)."
                )


def all_cpus(devices) -> bool:
    """Whether every device is a CPU: where a stage waits for its output's copy by default."""
    return all(tf.DeviceSpec.from_string(d).device_type == "CPU" for d in devices)


def check_split(x, y, micro_batches: int) -> None:
    """A batch that splits into `micro_batches` equal micro-batches, with one label per example."""
    n, labels = (x.shape[0] if x.shape.rank else None), (y.shape[0] if y.shape.rank else None)
    if n is None or n % micro_batches or n != labels:
        raise ValueError(
            f"a batch of {n} examples (and {labels} labels) does not split into {micro_batches} equal "
            f"micro-batches. Use a batch size that is a multiple of {micro_batches}, or batch with "
            "drop_remainder=True."
        )


def check_labels(loss_fn, y) -> None:
    """The default loss takes integer class ids of shape (batch,): say how to fix anything else."""
    if loss_fn is not models.cross_entropy:
        return
    if y.dtype.is_integer and y.shape.rank == 2 and y.shape[1] == 1:
        raise ValueError(f"labels of shape {y.shape} have an extra axis: pass tf.squeeze(y, axis=-1).")
    if y.dtype.is_floating and y.shape.rank == 2:
        raise ValueError(
            f"labels of shape {y.shape} and dtype {y.dtype.name} look one-hot; models.cross_entropy takes class "
            "ids: pass tf.argmax(y, axis=-1, output_type=tf.int32), or a loss_fn for one-hot labels."
        )
    if not y.dtype.is_integer or y.shape.rank != 1:
        raise ValueError(
            f"labels must be integer class ids of shape (batch,), got {y.shape} {y.dtype.name}: cast them with "
            "tf.cast(y, tf.int32)."
        )


def dry_run(stages, devices, x, y, micro_batches: int, loss_fn) -> None:
    """One micro-batch through the stages, eagerly and in inference mode (nothing changes): shapes
    and dtypes that fit, and a loss that is a mean. It also builds a Keras stage's weights."""
    rows = x.shape[0] // micro_batches
    h, labels = _sample(x, rows), _sample(y, rows)
    for s, (stage, device) in enumerate(zip(stages, devices, strict=True)):
        try:
            with tf.device(device):
                h = stage(h)
        except (tf.errors.InvalidArgumentError, ValueError, TypeError) as err:
            what = f"the output of stage {s - 1}" if s else "the micro-batch"
            raise ValueError(
                f"stage {s} cannot take {what} (shape {h.shape}, {h.dtype.name}): {str(err).splitlines()[0]}"
                f"{_dtype_hint(stage, h)}"
            ) from None
    check_mean_reduced(loss_fn, h, labels)


def check_mean_reduced(loss_fn, logits, labels) -> None:
    """Refuse a loss that is not a scalar or that sums over the examples: a micro-batch repeated
    twice has the same mean loss, but twice the sum."""
    one = loss_fn(logits, labels)
    if one.shape.rank != 0:
        raise ValueError(f"loss_fn must return a scalar (the mean over the micro-batch), got shape {one.shape}.")
    two = loss_fn(tf.concat([logits, logits], 0), tf.concat([labels, labels], 0))
    one, two = float(one), float(two)
    if abs(one) > 1e-6 and abs(two - 2 * one) <= 1e-3 * abs(one):
        raise ValueError(
            "loss_fn sums over the examples (twice the micro-batch gives twice the loss); the pipeline "
            "averages the M micro-batch losses, so return the mean over the micro-batch (tf.reduce_mean)."
        )


def _sample(t, rows):
    """The first `rows` of an eager tensor; for a symbolic one (a user's tf.function), stand-ins."""
    if isinstance(t, tf.__internal__.EagerTensor):
        return t[:rows]
    if t.dtype.is_floating:
        return tf.constant(np.random.default_rng(0).normal(size=(rows, *t.shape[1:])), t.dtype)
    return tf.zeros([rows, *t.shape[1:]], t.dtype)


def _dtype_hint(stage, h) -> str:
    dtypes = {v.dtype for v in stage.trainable_variables}
    if len(dtypes) == 1 and h.dtype not in dtypes:
        (want,) = dtypes
        want = tf.as_dtype(want)
        return f". The stage's variables are {want.name}: cast the input with tf.cast(x, tf.{want.name})."
    return ""
