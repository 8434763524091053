"""Data parallelism by hand: one Keras replica and one optimizer per device, gradients summed by NCCL.

The method train_multi_gpu.py trains, and the course's one copy of it: notebooks 03 and 04 define these
functions in their cells (each below a `# lesson:` line here), checked to be the same. Every line that
makes it multi-device runs under a `tf.device`. In short (train_multi_gpu.py's `build`):

    all_sum = make_all_sum(devices, nccl=True)  # replicas = make_replicas(make_model, devices)
    step = make_train_step(replicas, devices, replica_optimizers(replicas, devices, make_adam), all_sum)
"""

import itertools

import keras
import tensorflow as tf

# lesson: 03_nccl_allreduce
KEYS = itertools.count(1 << 30)  # an all_sum's group of devices, each all-reduce's instance: far above tf.distribute's


# lesson: 03_nccl_allreduce
def make_all_sum(devices, nccl, timeout=300.0):
    """all_sum(tensors): one tensor per device in, their sum on every device out, by TensorFlow's collective
    all-reduce (the op under MirroredStrategy's default): NCCL on distinct GPUs (`nccl`), a ring elsewhere.
    An op whose peers have not all come within `timeout` seconds raises DeadlineExceededError (a failed
    step cancels them at once): a device that fails stops the run instead of hanging it. Each device's
    ordering token (a variable, as tf.distribute uses) makes it start its all-reduces in program order,
    the same on every device, which NCCL needs. Differentiable: batch norm's statistics pass through it."""
    group, hint, tokens = next(KEYS), "nccl" if nccl else "ring", []
    for device in devices:
        with tf.device(device):
            tokens.append(tf.Variable(0.0, trainable=False, name="ordering_token"))

    def collective(t, token, key):
        return tf.raw_ops.CollectiveReduceV2(
            input=t, group_size=len(devices), group_key=group, instance_key=key, ordering_token=[token.handle],
            merge_op="Add", final_op="Id", communication_hint=hint, timeout_seconds=timeout)  # fmt: skip

    @tf.autograph.experimental.do_not_convert  # no Python control flow here; AutoGraph cannot read the lambda
    def on_device(t, token, key, gradient_key):
        @tf.custom_gradient  # TensorFlow registers no gradient for the op: a sum's is the sum of the gradients
        def summed(x):
            return collective(x, token, key), lambda g: collective(g, token, gradient_key)

        return summed(t)

    def build(tensors):
        key, gradient_key, summed = next(KEYS), next(KEYS), []  # the same key on every device: one all-reduce
        for t, device, token in zip(tensors, devices, tokens, strict=True):
            with tf.device(device), tf.name_scope("all_reduce"):
                summed.append(on_device(t, token, key, gradient_key))
        return summed

    def all_sum(tensors):  # eagerly, the first op would wait for peers that eager mode never starts
        return tf.function(build)(list(tensors)) if tf.executing_eagerly() else build(tensors)

    all_sum.tokens = tokens  # each device's own variable, for the placement audit
    return all_sum


# lesson: 03_nccl_allreduce
def make_replicas(make_model, devices):
    """One model per device, made under its device (every variable, Keras' dropout seed state too, is created
    there), all with the first one's initial weights (the broadcast). Keras' seed state is not copied: each
    replica draws its own dropout masks, as each GPU's share of the batch should."""
    replicas = []
    for device in devices:
        with tf.device(device):
            replicas.append(make_model())
    for replica in replicas[1:]:
        weights = getattr(replica, "weights", replica.variables)  # a Keras model's weights leave out seed states
        for v, first in zip(weights, getattr(replicas[0], "weights", replicas[0].variables), strict=True):
            v.assign(first)
    return replicas


# lesson: 03_nccl_allreduce
def replica_optimizers(replicas, devices, make_optimizer):
    """One optimizer per replica, made and built under the replica's device: its step counter, its learning
    rate and its slots (Adam's m and v) live beside the replica's weights, not on the default device."""
    optimizers = []
    for replica, device in zip(replicas, devices, strict=True):
        with tf.device(device):
            optimizer = make_optimizer()
            optimizer.build(replica.trainable_variables)
        optimizers.append(optimizer)
    return optimizers


# lesson: 03_nccl_allreduce
def cross_entropy(labels, logits):
    """Each example's loss, from LOGITS (the course's convention: a model ends without softmax)."""
    return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)


# lesson: 03_nccl_allreduce
def loss_part(replica, outputs, y, examples, replicas, loss_fn=cross_entropy):
    """One replica's part of the global batch's mean loss: its examples' losses summed and divided by the
    `examples` of ALL replicas, plus its share of the model's added losses (regularizers, add_loss). The
    parts add up to the loss one device computes on the whole batch. 16-bit outputs count in float32."""
    wide = tf.float64 if outputs.dtype == tf.float64 else tf.float32
    per_example = tf.cast(loss_fn(y, tf.cast(outputs, wide)), wide)
    added = tf.add_n([tf.cast(loss, wide) for loss in replica.losses]) if replica.losses else 0.0
    return tf.reduce_sum(per_example) / tf.cast(examples, wide) + added / replicas


# lesson: 03_nccl_allreduce
def summed_dtype(g):
    """What a gradient is summed in: float64 stays float64 (the check), everything else in float32 (a 16-bit
    sum loses digits, and NCCL's raw op takes no bfloat16)."""
    return tf.float64 if g.dtype == tf.float64 else tf.float32


# lesson: 03_nccl_allreduce
def bucket_plan(tensors, bucket_bytes):
    """The indices of `tensors` (None ones left out) in buckets of at most `bucket_bytes` (a larger tensor alone), one
    summed_dtype each, from the LAST: backprop yields the last layers' gradients first, so the first buckets can be
    summed while the earlier layers' are computed (Horovod's tensor fusion, PyTorch DDP's buckets). 0: one each."""
    plan, size = [], 0
    for j in reversed(range(len(tensors))):
        if tensors[j] is None:  # a weight the loss does not use: nothing to sum
            continue
        nbytes = tensors[j].shape.num_elements() * summed_dtype(tensors[j]).size
        if plan and size + nbytes <= bucket_bytes and summed_dtype(tensors[j]) == summed_dtype(tensors[plan[-1][0]]):
            plan[-1].append(j)
            size += nbytes
        else:
            plan.append([j])
            size = nbytes
    return plan


# lesson: 03_nccl_allreduce
def all_reduce_gradients(grads, devices, all_sum, bucket_bytes=0):
    """tensorpack's allreduce_grads for K replicas x N gradients, summed: each replica's gradients packed on its
    device into the buckets of bucket_plan (16-bit ones in float32), one all-reduce per bucket, unpacked on each
    replica's device in each gradient's own dtype. None gradients stay None."""
    plan, out = bucket_plan(grads[0], bucket_bytes), [list(g) for g in grads]
    for bucket in plan:
        packed = []
        for g, device in zip(grads, devices, strict=True):
            with tf.device(device):
                packed.append(tf.concat([tf.reshape(tf.cast(g[j], summed_dtype(g[j])), [-1]) for j in bucket], 0))
        for replica, vector, device in zip(out, all_sum(packed), devices, strict=True):
            with tf.device(device):
                pieces = tf.split(vector, [grads[0][j].shape.num_elements() for j in bucket])
                for j, piece in zip(bucket, pieces, strict=True):
                    replica[j] = tf.cast(tf.reshape(piece, grads[0][j].shape), grads[0][j].dtype)
    return out


# lesson: 04_sync_batchnorm
def local_moments(x):
    """One device's row [count, mean (C), M2 (C)] over all axes but the last: in float64 for float64 inputs (as
    the check runs), else in float32 (16-bit inputs too, as Keras computes their statistics)."""
    dtype = tf.float64 if x.dtype == tf.float64 else tf.float32
    x = tf.cast(tf.reshape(x, [-1, x.shape[-1]]), dtype)
    count = tf.cast(tf.shape(x)[0], dtype)
    mean = tf.math.divide_no_nan(tf.reduce_sum(x, 0), count)  # 0, not NaN, for an empty batch
    m2 = tf.reduce_sum(tf.square(x - mean), 0)  # centred around this device's own mean
    return tf.concat([[count], mean, m2], 0)


# lesson: 04_sync_batchnorm
def combine_moments(rows):
    """Chan et al.: M2 = sum M2_i + sum n_i (mean_i - mean)^2. Returns (count, mean, variance); zeros for none."""
    c = (rows.shape[-1] - 1) // 2
    counts, means, m2s = rows[:, :1], rows[:, 1 : 1 + c], rows[:, 1 + c :]
    count = tf.reduce_sum(counts)
    mean = tf.math.divide_no_nan(tf.reduce_sum(counts * means, 0), count)
    m2 = tf.reduce_sum(m2s, 0) + tf.reduce_sum(counts * tf.square(means - mean), 0)
    return count, mean, tf.math.divide_no_nan(m2, count)


# lesson: 04_sync_batchnorm
def sync_batch_norm(layers, devices, hs, all_sum):
    """Keras BatchNormalization layers, one per replica, applied in training with the statistics of the global
    batch: every device's local_moments row, in its own slot of a matrix of zeros, summed by ONE all-reduce,
    then merged on each device. Each replica's moving statistics move as Keras moves them, so the replicas keep
    equal ones. (sync_bn_problem says which layers this cannot take.)"""
    n, slots = len(hs), []
    for i, (h, device) in enumerate(zip(hs, devices, strict=True)):
        with tf.device(device):
            slots.append(tf.pad(local_moments(h)[None], [[i, n - 1 - i], [0, 0]]))
    out = []
    for layer, h, device, rows in zip(layers, hs, devices, all_sum(slots), strict=True):
        with tf.device(device):
            _, mean, variance = combine_moments(rows)
            for moving, batch in ((layer.moving_mean, mean), (layer.moving_variance, variance)):
                moved = tf.cast(moving, mean.dtype) * layer.momentum + batch * (1 - layer.momentum)
                moving.assign(tf.cast(moved, moving.dtype))
            gamma, beta = (None if v is None else tf.cast(v, mean.dtype) for v in (layer.gamma, layer.beta))
            y = tf.nn.batch_normalization(tf.cast(h, mean.dtype), mean, variance, beta, gamma, layer.epsilon)
            out.append(tf.cast(y, h.dtype))
    return out


# lesson: 04_sync_batchnorm
def replicated_forward(replicas, devices, xs, all_sum):
    """Each Sequential replica's training forward on its share xs[i], layer by layer, in lockstep: the replicas'
    BatchNormalization layers by sync_batch_norm, every other layer as Keras runs it, on the replica's device."""
    hs = list(xs)
    for layers in zip(*(replica.layers for replica in replicas), strict=True):
        if isinstance(layers[0], keras.Sequential):  # a block of layers: walked in turn, its BN synchronized too
            hs = replicated_forward(layers, devices, hs, all_sum)
        elif isinstance(layers[0], keras.layers.BatchNormalization) and layers[0].trainable:
            hs = sync_batch_norm(layers, devices, hs, all_sum)
        else:  # a frozen BatchNormalization (trainable=False) too: Keras then uses its moving statistics
            for i, (layer, device) in enumerate(zip(layers, devices, strict=True)):
                with tf.device(device):
                    hs[i] = layer(hs[i], training=True)
    return hs


# lesson: 03_nccl_allreduce
def replica_gradients(replica, optimizer, replicas, loss_fn=cross_entropy, jit=False):
    """A function of one replica's share (x, y) and the global batch's example count: its part of the loss
    (loss_part) and the gradients of that part, scaled by the optimizer (a LossScaleOptimizer's loss scale; 1 for
    others), on ONE device: called under the replica's device, the tape's backward runs there too. jit: the whole
    function compiled by XLA into one call."""

    def compute(x, y, examples):
        with tf.GradientTape() as tape:
            part = loss_part(replica, replica(x, training=True), y, examples, replicas, loss_fn)
            scaled = optimizer.scale_loss(part)
        return part, tape.gradient(scaled, replica.trainable_variables)

    return tf.function(compute, jit_compile=True) if jit else compute


# lesson: 04_sync_batchnorm
def synced_gradients(replicas, devices, optimizers, xs, ys, all_sum, loss_fn=cross_entropy):
    """Every replica's part of the loss and its gradients with batch norm synchronized: the statistics couple the
    replicas, so ONE tf.gradients over the sum of the parts, which builds each gradient op beside the forward op
    it differentiates (a tape would build them all under the device of its gradient() call). Each replica's copy
    of a weight then gets its gradient through every replica's loss: the all-reduced SUM is the batch's."""
    n, k = len(devices), len(replicas[0].trainable_variables)
    outputs = replicated_forward(replicas, devices, xs, all_sum)
    parts, scaled = [], []
    for device, replica, optimizer, out, y in zip(devices, replicas, optimizers, outputs, ys, strict=True):
        with tf.device(device):
            parts.append(loss_part(replica, out, y, n * tf.shape(y)[0], n, loss_fn))  # equal shares
            scaled.append(optimizer.scale_loss(parts[-1]))
    flat = tf.gradients(scaled, [v.value for r in replicas for v in r.trainable_variables])  # of their sum
    return parts, [flat[i * k : (i + 1) * k] for i in range(n)]


# lesson: 04_sync_batchnorm
def make_train_step(replicas, devices, optimizers, all_sum, sync_bn=True, bucket_bytes=0, jit=False,
                    loss_fn=cross_entropy):  # fmt: skip
    """A tf.function of (iterators, k): k training steps in ONE call, each taking one share from each device's
    iterator (already on its device): each replica's part of the loss and its gradients (synced_gradients, or
    each replica alone: replica_gradients), all-reduced in buckets of bucket_bytes, applied by each replica's
    own optimizer on its device. Returns the mean loss of the k steps. One call of k steps pays the host's work
    per call (Python, launching the function, reading the loss back) once for k steps (notebook 06)."""
    n = len(devices)
    alone = [replica_gradients(r, o, n, loss_fn, jit) for r, o in zip(replicas, optimizers, strict=True)]

    def one_step(iterators):
        xs, ys = zip(*(next(iterator) for iterator in iterators), strict=True)
        saved = [statistics_before(o, r, d) for o, r, d in zip(optimizers, replicas, devices, strict=True)]
        if sync_bn:
            parts, grads = synced_gradients(replicas, devices, optimizers, xs, ys, all_sum, loss_fn)
        else:
            parts, grads = [], []
            for device, compute, x, y in zip(devices, alone, xs, ys, strict=True):
                with tf.device(device):
                    part, g = compute(x, y, n * tf.shape(y)[0])  # equal shares
                parts.append(part)
                grads.append(g)
        grads = all_reduce_gradients(grads, devices, all_sum, bucket_bytes)
        for device, replica, optimizer, g, kept in zip(devices, replicas, optimizers, grads, saved, strict=True):
            with tf.device(device):
                pairs = [(gv, v) for gv, v in zip(g, replica.trainable_variables, strict=True) if gv is not None]
                optimizer.apply_gradients(pairs)
                keep_statistics_if_skipped(g, replica.non_trainable_variables, kept)
        return tf.add_n(parts)

    @tf.function
    def step(iterators, k):
        with tf.device(devices[0]):  # the loss is summed and read here; each replica's ops name their own device
            total = tf.zeros([], tf.float64 if replicas[0].trainable_variables[0].dtype == "float64" else tf.float32)
            for _ in range(k):  # autograph: a tf.while_loop for a tensor k, unrolled for a Python int
                total += tf.cast(one_step(iterators), total.dtype)
            return total / tf.cast(k, total.dtype)

    return step


# lesson: 04_sync_batchnorm
def statistics_before(optimizer, replica, device):
    """A LossScaleOptimizer's replica: its non-trainable variables (batch norm's statistics), read on its device
    before the forward, for keep_statistics_if_skipped. None for other optimizers, which skip no step."""
    if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return None
    with tf.device(device):
        return [tf.identity(v) for v in replica.non_trainable_variables]


# lesson: 04_sync_batchnorm
def keep_statistics_if_skipped(grads, variables, saved):
    """A LossScaleOptimizer (float16) skips a step whose gradients overflowed, but the forward has already moved batch
    norm's moving statistics (to inf or NaN, for good): put them back (`saved`, read before the forward), as the
    skipped step leaves the weights. Nothing to do for other optimizers (saved is None)."""
    if saved is not None:
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads if g is not None])
        for v, value in zip(variables, saved, strict=True):
            v.assign(tf.where(finite, v, value))


# lesson: 03_nccl_allreduce
STRATEGY_KEYS = itertools.count(1 << 20, 1 << 16)  # each strategy's first collective group key


# lesson: 03_nccl_allreduce
def mirrored_strategy(devices, cross_device_ops=None):
    """A MirroredStrategy with collective keys of its own. Every MirroredStrategy numbers its all-reduce groups from
    the same PRIVATE class attribute _collective_key_base, so a second one over other devices in the same process
    fails ("... is joining a group with size 3, but that group has size 4"). It is set for this strategy and put
    back, as TensorFlow's own tests set it; the public route is one strategy per process."""
    cls = tf.distribute.MirroredStrategy
    base, cls._collective_key_base = cls._collective_key_base, next(STRATEGY_KEYS)
    try:  # read once, while the strategy is made
        return cls(devices, cross_device_ops=cross_device_ops)
    finally:
        cls._collective_key_base = base


# lesson: 03_nccl_allreduce
def mirrored_train_step(strategy, model, optimizer, loss_fn=cross_entropy, jit=False):
    """make_train_step's twin under `strategy`: a tf.function of (iterator, k), k steps in one call from a
    distributed iterator (strategy.experimental_distribute_dataset), their mean loss back. Each replica's
    loss_part divides by the examples the whole batch holds (all-reduced: a short last batch holds fewer);
    apply_gradients sums the replicas' gradients (MirroredStrategy's all-reduce) and updates every copy."""
    compute = replica_gradients(model, optimizer, strategy.num_replicas_in_sync, loss_fn, jit)

    def replica_step(x, y):
        examples = tf.distribute.get_replica_context().all_reduce("SUM", tf.shape(y)[0])
        part, grads = compute(x, y, examples)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return part

    @tf.function
    def step(iterator, k):
        with tf.device(strategy.extended.worker_devices[0]):  # the loss, summed and read on the first device
            total = tf.zeros([], tf.float64 if model.trainable_variables[0].dtype == "float64" else tf.float32)
            for _ in range(k):  # autograph: a tf.while_loop for a tensor k, unrolled for a Python int
                total += tf.cast(strategy.reduce("SUM", strategy.run(replica_step, next(iterator)), None), total.dtype)
            return total / tf.cast(k, total.dtype)

    return step
