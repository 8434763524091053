"""A pipeline at scale, beside pipeline_parallel.py's step: R data-parallel replicas of the pipeline, each stage's
gradients summed among its replicas by data_parallel.py's all-reduce as soon as they are done, while other devices
still work (the deferred W's of a zero-bubble schedule); and what spans the stages: the global gradient norm
(clipping) and the overflow check of float16's loss scaling, applied as the zero-bubble paper's optimizer
post-validation (Qi et al., ICLR 2024, arXiv:2401.10241, sec. 4). Notebook 05's deep dives teach the functions
below their `# lesson:` lines; train_pipelined.py's --replicas and --clipnorm train with them.

Post-validation. Where every stage's update waits for the global state (a reduction over all stages), the stage
that finishes first waits for the last. Instead each device, once its gradients are done, adds its own part of the
state to the partial state of the devices that finished before it and passes it on, and steps at once unless that
partial state already forbids it (a value not finite, a norm past the threshold); the full state, reached at the
device that finishes last, comes back to every device, which then validates its step: where it was wrong, the
step is rolled back and redone from the global state. The rollback here restores a copy of the weights and the
optimizer's state taken before the step; the paper inverts the step in place (its appendix C), which saves the copy.
"""

from types import SimpleNamespace

import data_parallel as dp
import pipeline_parallel as pp
import pipeline_schedules as ps
import tensorflow as tf


# lesson: 05_staging_pipeline
def replicate(make_chunks, devices, placement, make_optimizer):
    """R = len(devices) / S copies of one pipeline of S devices: replica r runs on devices[r*S : (r+1)*S], its
    chunk k on the device that `placement[k]` names there, made by `make_chunks(on)` (on: each chunk's device) and
    given replica 0's weights (the broadcast); one optimizer per chunk on its device. Returns per replica its
    chunks, each chunk's device, its optimizers and its S devices."""
    S = max(placement) + 1
    if len(devices) % S:
        raise ValueError(f"{len(devices)} devices do not hold {S} stages a replica: give a multiple of {S} devices")
    replicas = []
    for r in range(len(devices) // S):
        mine = devices[r * S : (r + 1) * S]
        on = [mine[d] for d in placement]
        chunks = make_chunks(on)
        for chunk, first in zip(chunks, replicas[0].chunks if replicas else [], strict=False):
            for v, w in zip(getattr(chunk, "weights", chunk.variables), getattr(first, "weights", first.variables),
                            strict=True):  # fmt: skip
                v.assign(w)
        optimizers = pp.one_optimizer_per_stage(chunks, on, make_optimizer)
        replicas.append(SimpleNamespace(chunks=chunks, devices=on, optimizers=optimizers, physical=mine))
    return replicas


# lesson: 05_staging_pipeline
def stage_all_sums(replicas, nccl):
    """{chunk k: the all-sum over chunk k's devices in every replica} (data_parallel.make_all_sum): one per group
    of devices, so that a device holding two chunks (interleaving, ZB-V) starts its all-reduces in one order."""
    sums, groups = {}, {}
    for k in range(len(replicas[0].chunks)):
        group = tuple(rep.devices[k] for rep in replicas)
        if group not in groups:
            groups[group] = dp.make_all_sum(list(group), nccl)
        sums[k] = groups[group]
    return sums


# lesson: 05_staging_pipeline
def all_reduce_stages(grads, replicas, all_sums):
    """grads[r][k]: replica r's gradients of chunk k, of its share's mean loss. Each chunk's summed over the
    replicas (one all-reduce per gradient, the last chunk's first) and divided by R, on each replica's device: the
    whole batch's mean gradient everywhere. Nothing else waits for them, so each runs once its chunk is done."""
    R, out = len(replicas), [list(g) for g in grads]
    for k in reversed(range(len(grads[0]))):
        on = [rep.devices[k] for rep in replicas]
        summed = dp.all_reduce_gradients([g[k] for g in grads], on, all_sums[k])
        for r, (device, g) in enumerate(zip(on, summed, strict=True)):
            with tf.device(device):
                out[r][k] = [t / R for t in g]
    return out


# lesson: 05_staging_pipeline
def local_state(grads, device, loss_scale):
    """On `device`: its gradients unscaled (divided by the loss scale, read there) and its part of the global
    state, [their sum of squares, how many of their values are not finite]."""
    with tf.device(device):
        scale = tf.identity(loss_scale)  # copied here
        unscaled = [g / tf.cast(scale, g.dtype) for g in grads]
        wide = tf.float64 if unscaled and unscaled[0].dtype == tf.float64 else tf.float32
        squares = tf.add_n([tf.reduce_sum(tf.square(tf.cast(g, wide))) for g in unscaled] + [tf.zeros([], wide)])
        bad = tf.add_n([tf.reduce_sum(tf.cast(~tf.math.is_finite(g), wide)) for g in unscaled] + [tf.zeros([], wide)])
        return unscaled, tf.stack([squares, bad])


# lesson: 05_staging_pipeline
def verdict(state, clip_norm):
    """What a (partial or global) state says of a step: (its gradients are finite, no clipping is needed, the
    factor of the gradients: clip_norm / norm past the threshold, as Keras' global_clipnorm computes it)."""
    finite = tf.equal(state[1], 0) & tf.math.is_finite(state[0])
    if clip_norm is None:
        return finite, tf.constant(True), tf.ones([], state.dtype)
    norm = tf.sqrt(state[0])
    return finite, norm <= clip_norm, clip_norm * tf.minimum(1 / norm, 1 / clip_norm)


# lesson: 05_staging_pipeline
def finishing_order(orders, placement=None):
    """The devices in the order they finish their step's ops (simulated with F = B = W; on a tie, the later stage
    first): the order in which the partial state passes from device to device (stage 0 first in the paper's ZB-H2;
    last in 1F1B and ZB-H1, whose first stage runs the step's last backward)."""
    end = {}
    for d, *_, start, took in ps.simulate(orders, placement=placement):
        end[d] = max(end.get(d, 0.0), start + took)
    return sorted(end, key=lambda d: (end[d], -d))


# lesson: 05_staging_pipeline
def device_update(rep, ks, unscaled, partial, whole, clip_norm, post_validate):
    """The update of chunks `ks` of replica `rep` (one device), their gradients `unscaled`, under the global state
    `whole` (and, validated after, the `partial` state that reached the device). Returns the ops that end with
    every write, and whether a step taken at once was rolled back."""
    variables = [v for k in ks for v in rep.chunks[k].trainable_variables]
    kept = variables + [v for k in ks for v in rep.optimizers[k].variables]
    saved = [tf.identity(v) for v in kept] if post_validate else []  # the copy a rollback restores

    def step(factor):
        first = 0
        for k in ks:
            mine = list(rep.chunks[k].trainable_variables)
            grads = [g * tf.cast(factor, g.dtype) for g in unscaled[first : first + len(mine)]]
            rep.optimizers[k].apply(grads, mine)
            first += len(mine)
        return tf.constant(True)

    finite, unclipped, factor = verdict(whole, clip_norm)
    if not post_validate:  # every update waits for the global state
        tf.cond(finite, lambda: step(factor), lambda: tf.constant(False))
        return [tf.identity(v) for v in kept], tf.constant(False)
    ok, unclipped_so_far, _ = verdict(partial, clip_norm)
    eager = ok & unclipped_so_far  # the partial state forbids no step: take it now
    tf.cond(eager, lambda: step(tf.ones([], factor.dtype)), lambda: tf.constant(False))
    wrong = ~(eager & finite & unclipped)  # validated: the step taken at once was not the step to take

    def redo():
        for v, value in zip(kept, saved, strict=True):
            v.assign(value)  # the rollback (a no-op where no step was taken)
        return tf.cond(finite, lambda: step(factor), lambda: tf.constant(False))

    tf.cond(wrong, redo, lambda: tf.constant(False))
    return [tf.identity(v) for v in kept], eager & wrong  # a read runs after the variable's writes


# lesson: 05_staging_pipeline
def validated_updates(rep, grads, chain, clip_norm, loss_scale, post_validate=True):
    """Replica `rep`'s updates under the state of all its devices, its gradients per chunk (`grads`, scaled by
    `loss_scale`): each device, in the order `chain` (lanes, finishing_order), unscales its gradients, adds its
    part of the state to the partial state passed on by the one before, and steps (post-validation) or waits for
    the whole state. Returns (ops that end with every write, the global state, how many devices rolled back)."""
    lanes = {}
    for k, device in enumerate(rep.devices):
        lanes.setdefault(device, []).append(k)
    devices = [rep.physical[d] for d in chain]
    unscaled, partial, before = {}, {}, None
    for device in devices:
        unscaled[device], state = local_state([g for k in lanes[device] for g in grads[k]], device, loss_scale)
        with tf.device(device):
            before = partial[device] = state if before is None else state + tf.identity(before)
    updates, rolled = [], []
    for device in devices:
        with tf.device(device), tf.name_scope("update"):
            whole = tf.identity(before)  # the global state, back from the last device
            made, back = device_update(rep, lanes[device], unscaled[device], partial[device], whole, clip_norm,
                                       post_validate)  # fmt: skip
            updates += made
            rolled.append(tf.cast(back, tf.int32))
    with tf.device(devices[-1]):
        return updates, before, tf.add_n(rolled)


# lesson: 05_staging_pipeline
def make_loss_scale(device, initial=2.0**15, growth_steps=2000):
    """float16's dynamic loss scale on `device`, as keras.optimizers.LossScaleOptimizer keeps it: halved at a step
    whose gradients are not finite (which is skipped), doubled after `growth_steps` steps that were."""
    with tf.device(device):
        return SimpleNamespace(scale=tf.Variable(initial, dtype=tf.float32, trainable=False, name="loss_scale"),
                               good=tf.Variable(0, dtype=tf.int64, trainable=False, name="good_steps"),
                               growth_steps=growth_steps)  # fmt: skip


# lesson: 05_staging_pipeline
def update_loss_scale(loss_scale, state):
    """The loss scale's next value from the step's global state: Keras' LossScaleOptimizer's rule."""
    finite = tf.equal(state[1], 0) & tf.math.is_finite(state[0])
    grow = finite & tf.equal(loss_scale.good, loss_scale.growth_steps - 1)
    factor = tf.where(finite, tf.where(grow, 2.0, 1.0), 0.5)
    return [loss_scale.scale.assign(loss_scale.scale * factor),
            loss_scale.good.assign(tf.where(finite & ~grow, loss_scale.good + 1, 0))]  # fmt: skip


# lesson: 05_staging_pipeline
def make_replicated_train_steps(replicas, orders, loss_fn, all_sums=None, clip_norm=None, loss_scales=None,
                                post_validate=True, recompute=False, wait_for_arrival=True,
                                placement=None):  # fmt: skip
    """A `tf.function` of (xs, ys), lists of K batches: K steps in ONE call of R replicas of one pipeline
    (`replicate`), replica r on the r-th of R equal shares of each batch, each chunk's gradients all-reduced among
    its replicas (`all_sums`, where R > 1), every update under the global state (clipping by `clip_norm`; float16's
    loss scaling where `loss_scales`, one per replica, make_loss_scale). Returns the K mean losses and, per step,
    how many devices rolled back a step taken at once."""
    R, chain = len(replicas), finishing_order(orders, placement)
    if R > 1 and all_sums is None:
        raise ValueError(f"{R} replicas need all_sums, one all-sum per stage's devices: stage_all_sums(replicas, nccl)")
    if clip_norm is not None and not clip_norm > 0:
        raise ValueError(f"clip_norm must be a positive number (the largest global norm kept), got {clip_norm!r}")

    @tf.function(autograph=False)
    def train_steps(xs, ys):
        losses, rollbacks, applied = [], [], []
        for x, y in zip(xs, ys, strict=True):
            parts, grads, scales = [], [], []
            for rep, xr, yr, ls in zip(replicas, tf.split(x, R), tf.split(y, R), loss_scales or [None] * R,
                                       strict=True):  # fmt: skip
                with tf.device(rep.physical[-1]):
                    scales.append(tf.ones([]) if ls is None else tf.identity(ls.scale))
                loss, g = pp.pipelined_gradients(rep.chunks, rep.devices, orders, xr, yr, loss_fn, recompute,
                                                 wait_for_arrival, applied, placement, ls and scales[-1])  # fmt: skip
                parts.append(loss)
                grads.append(g)
            grads = all_reduce_stages(grads, replicas, all_sums) if R > 1 else grads
            applied, rolled = [], []
            for rep, g, scale, ls in zip(replicas, grads, scales, loss_scales or [None] * R, strict=True):
                made, state, back = validated_updates(rep, g, chain, clip_norm, scale, post_validate)
                with tf.device(rep.physical[-1]):
                    applied += made + (update_loss_scale(ls, tf.identity(state)) if ls else [])
                rolled.append(back)
            with tf.device(replicas[0].devices[-1]):
                losses.append(tf.add_n(parts) / R)
                rollbacks.append(tf.add_n(rolled))
        with tf.device(replicas[0].devices[-1]):
            return tf.stack(losses), tf.stack(rollbacks)

    return train_steps
