"""Train a CNN on N GPUs with NCCL all-reduce, without Estimator or fit: the program to copy, with its folder.

Your model goes in make_model below; it returns LOGITS. The method is data_parallel.py (notebooks 03 and
04): one Keras replica and one Adam per GPU, the gradients summed by NCCL (by a ring where NCCL cannot
run), batch norm over the whole batch. check_data_parallel.py holds --check (against one device),
--baseline and --breakdown. Accuracy and images/s each epoch; checkpoints with --checkpoint.

    python train_multi_gpu.py [--devices /GPU:0,/GPU:1] [--epochs 5] [--batch 128]
    python train_multi_gpu.py --check --steps 20          # the same weights as one device?
    python train_multi_gpu.py --strategy mirrored         # TensorFlow's MirroredStrategy instead
    python train_multi_gpu.py --baseline --breakdown      # against one GPU; where a step's time goes
"""

import inspect
import sys
import time
from types import SimpleNamespace

import checkpoints
import common  # first: it imports TensorFlow with its start-up lines filtered
import data_parallel as dp
import data_parallel_checks as checks
import keras
import multi_gpu_cli as cli
import numpy as np
import tensorflow as tf


# ---------------------------------------------------------------------------------------------------------------
# YOUR MODEL: the one place to change. Images of input_shape in, 10 LOGITS out (no softmax: the loss applies it).
# Any Keras layers train. Batch norm is synchronized over the whole batch (--bn sync) where the model is a
# keras.Sequential whose BatchNormalization layers are among its layers (at any depth of Sequential blocks);
# anywhere else --bn local keeps each GPU's own statistics, and --strategy mirrored synchronizes it by Keras.
def make_model(input_shape, synchronized=False):
    """The CNN: two 3x3 convolutions, each with batch norm, ReLU and 2x2 pooling, then 10 logits."""
    block = lambda filters: [  # noqa: E731
        keras.layers.Conv2D(filters, 3, padding="same", use_bias=False),  # BN's beta is the bias
        keras.layers.BatchNormalization(momentum=0.9, synchronized=synchronized),  # Keras: 0.99, slow for short runs
        keras.layers.ReLU(),
        keras.layers.MaxPooling2D(2),
    ]
    head = "float32" if keras.config.dtype_policy().name.startswith("mixed") else None  # 16-bit: float32 logits
    return keras.Sequential(
        [keras.Input(input_shape), *block(32), *block(64), keras.layers.Flatten(), keras.layers.Dense(10, dtype=head)]
    )


# ---------------------------------------------------------------------------------------------------------------


def build(args, devices, input_shape, make_optimizer=None, all_sum=None):
    """What a run trains: step(feed, k), feed(x, y, skip) (built once), the model to evaluate and save with its
    optimizer, restored() (the saved replica's state onto the others), every replica's weights (batch norm's
    statistics too; not the random layers' seed states, which each replica keeps its own) and owners. The checks
    build it with another optimizer, or another all_sum."""
    make_optimizer = make_optimizer or (lambda: cli.optimizer(args))
    if args.strategy == "mirrored":
        cross_device_ops = tf.distribute.ReductionToOneDevice() if args.all_reduce == "central" else None
        strategy = dp.mirrored_strategy(devices, cross_device_ops)
        with strategy.scope():  # one copy of every variable per device, Adam's too
            synchronized = {"synchronized": True} if args.bn == "sync" and takes_synchronized() else {}
            model, optimizer = make_model(input_shape, **synchronized), make_optimizer()
            optimizer.build(model.trainable_variables)
        copies = [strategy.experimental_local_results(v.value) for v in [*model.weights, *optimizer.variables]]
        per_device = [list(vs) for vs in zip(*copies, strict=True)]  # each device's own copies
        return SimpleNamespace(
            step=dp.mirrored_train_step(strategy, model, optimizer, jit=args.jit),
            model=model,
            optimizer=optimizer,
            feed=lambda x, y, skip=0: iter(strategy.experimental_distribute_dataset(batches(x, y, args, skip))),
            restored=lambda: None,
            weights=[vs[: len(model.weights)] for vs in per_device],
            owners=dict(zip(devices, per_device, strict=True)),  # what each device holds: for a placement audit
        )
    replicas = dp.make_replicas(lambda: make_model(input_shape), devices)
    optimizers = dp.replica_optimizers(replicas, devices, make_optimizer)
    all_sum = all_sum or dp.make_all_sum(devices, nccl=args.nccl, timeout=args.timeout)
    step = dp.make_train_step(replicas, devices, optimizers, all_sum, args.bn == "sync", args.bucket_bytes, args.jit)

    def restored():  # a checkpoint holds replica 0 and its optimizer
        first = [*replicas[0].weights, *optimizers[0].variables]
        for replica, optimizer in zip(replicas[1:], optimizers[1:], strict=True):
            for v, value in zip([*replica.weights, *optimizer.variables], first, strict=True):
                v.assign(value)

    return SimpleNamespace(
        step=step,
        model=replicas[0],
        optimizer=optimizers[0],
        restored=restored,
        feed=lambda x, y, skip=0: device_feeds(x, y, args, devices, skip),
        all_sum=all_sum,
        weights=[r.weights for r in replicas],
        replicas=replicas,
        owners=owned(devices, replicas, optimizers, getattr(all_sum, "tokens", [])),
    )


def owned(devices, replicas, optimizers, tokens):
    """{device: what it holds}: its replica's variables, its optimizer's, its all-reduce ordering token (a stand-in
    all_sum has none). What a placement audit checks each op against (tutorial_lib.placement)."""
    tokens = [[t] for t in tokens] or [[] for _ in devices]
    held = zip(devices, replicas, optimizers, tokens, strict=True)
    return {d: [*r.variables, *o.variables, *t] for d, r, o, t in held}


def batches(x, y, args, skip=0):
    """The run's global batches, built once: the training set reshuffled each epoch by --seed (the same order
    wherever it is built), the short last batch of each epoch dropped (every device gets batch/N examples),
    the first `skip` batches left out (a resumed run)."""
    order = tf.data.Dataset.range(len(x)).shuffle(len(x), seed=args.seed, reshuffle_each_iteration=True)
    x, y = tf.constant(x), tf.constant(y)
    picked = order.batch(args.batch, drop_remainder=True).repeat().skip(skip)
    return picked.map(lambda rows: (tf.gather(x, rows), tf.gather(y, rows)))


def device_feeds(x, y, args, devices, skip=0):
    """One input pipeline per device: share i of each global batch, prefetched onto device i by tf.data while
    the step before runs. Built once for the run, not per epoch."""
    n, feeds = len(devices), []
    for i, device in enumerate(devices):
        share = batches(x, y, args, skip).map(lambda x, y, i=i: (tf.split(x, n)[i], tf.split(y, n)[i]))
        feeds.append(iter(share.apply(tf.data.experimental.prefetch_to_device(device, 2))))
    return feeds


def train(args, run, data, saver):
    """--epochs epochs (or --steps steps) of --steps-per-call steps a call; the loss, test accuracy and images/s
    each epoch, from the time between the first call's end (it traces the step) and the epoch's last."""
    (x, y), (x_test, y_test) = data
    per_epoch, done = len(x) // args.batch, saver.done
    total = min(args.steps or args.epochs * per_epoch, args.epochs * per_epoch)
    feed, metrics, timed, seconds, profiling = run.feed(x, y, skip=done), {}, 0, 0.0, False
    writer = tf.summary.create_file_writer(args.logdir) if args.logdir else None
    if done >= total:  # a resumed run already as long as this one: no loss, accuracy nor timing to say
        print(f"checkpoint: nothing to train: ckpt-{done} has done {done} steps, and this run asks {total}; give "
              "more --steps or --epochs")  # fmt: skip
    while done < total:
        epoch, steps = done // per_epoch, min(per_epoch - done % per_epoch, total - done)
        print(f"epoch {epoch + 1}/{args.epochs}")
        progress, losses, start, epoch_timed = keras.utils.Progbar(steps), [], time.perf_counter(), 0
        while len(losses) < steps:
            profiling = profile(args, timed, profiling)
            k = min(args.steps_per_call, steps - len(losses))
            calls = 1 if args.steps_per_call == 1 else tf.constant(k)  # a loop of k steps; 1: no loop around it
            losses += [float(run.step(feed, calls))] * k  # float(): the host waits for the call (one trace for any k)
            if not timed and not epoch_timed:  # the first call traces the step: not what a step costs
                print(f"  the first call traced the step and ran {k} step(s) in {time.perf_counter() - start:.1f} s")
                start, epoch_timed = time.perf_counter(), -k
            progress.update(len(losses), [("loss", losses[-1])])
        epoch_seconds, epoch_timed, done = time.perf_counter() - start, epoch_timed + steps, done + steps
        timed, seconds = timed + epoch_timed, seconds + epoch_seconds
        metrics = {
            "loss": np.mean(losses),
            "train_accuracy": accuracy(run.model, x[:2000], y[:2000]),
            "test_accuracy": accuracy(run.model, x_test, y_test),
            "images_per_second": epoch_timed * args.batch / epoch_seconds if epoch_timed else np.nan,
        }
        print("  ".join(f"{k} {v:,.0f}" if "second" in k else f"{k} {v:.3f}" for k, v in metrics.items()))
        if writer:
            with writer.as_default(step=epoch):
                for name, value in metrics.items():
                    tf.summary.scalar(name, value)
        saver.save(done)
    if profiling:
        tf.profiler.experimental.stop()
    step_ms = 1000 * seconds / timed if timed else np.nan
    print(
        f"timing: {timed} timed steps of {args.batch} images, {step_ms:.1f} ms a step "
        f"({args.batch / step_ms * 1000:,.0f} images/s); --breakdown splits a step into input, compute and all-reduce"
    )
    return {**metrics, "steps": done, "trained_steps": done - saver.done, "step_ms": step_ms}


def profile(args, timed, profiling):
    """--profile: a profiler trace of this run's calls after its first (which traces the step), until 3 steps."""
    if args.profile and not profiling and timed == 0:
        tf.profiler.experimental.start(args.logdir)
        return True
    if profiling and timed >= 3:
        tf.profiler.experimental.stop()
        return False
    return profiling


PREDICT = {}  # one tf.function per model: a new one per call would trace anew


def accuracy(model, x, y, batch=1000):
    """The share of x that `model` classifies right, in inference mode (batch norm's moving statistics)."""
    if id(model) not in PREDICT:
        PREDICT[id(model)] = tf.function(lambda xs: tf.argmax(model(xs, training=False), -1, output_type=tf.int32))
    predicted = np.concatenate([PREDICT[id(model)](x[i : i + batch]).numpy() for i in range(0, len(x), batch)])
    return float(np.mean(predicted == y))


def mirrored_sync_problem(model):
    """Why MirroredStrategy would leave `model`'s batch norm unsynchronized, or None: Keras synchronizes the
    BatchNormalization layers made with synchronized=True (`model` was asked for it), which make_model must pass on
    to each of them."""
    norms = [x for x in common.all_layers(model) if isinstance(x, keras.layers.BatchNormalization) and x.trainable]
    if norms and not takes_synchronized():
        return f"make_model takes no synchronized argument: {PASS_IT_ON}"
    if left := [x.name for x in norms if not x.synchronized]:
        return f"make_model(synchronized=True) leaves {left[0]} unsynchronized: {PASS_IT_ON}"
    return None


PASS_IT_ON = "pass synchronized on to each BatchNormalization"


def takes_synchronized():
    """Does make_model take `synchronized` (a reader's may have dropped it)?"""
    kinds = {p.name: p.kind for p in inspect.signature(make_model).parameters.values()}
    return "synchronized" in kinds or inspect.Parameter.VAR_KEYWORD in kinds.values()


def plan(args, devices, data):
    """Everything decided before any work, said, or refused with the fix: batch norm, the all-reduce, the model."""
    (x, _), n = data[0], len(devices)
    if args.batch % n or args.batch > len(x):
        most = len(x) // n * n
        common.refuse(
            f"--batch {args.batch}: give a multiple of the {n} devices, at most the {len(x)} training "
            f"images, e.g. {min(max(n, args.batch // n * n), most)}"
        )
    replicated = args.strategy == "replicated"
    with cli.precision(args.precision):
        asked = {} if replicated or not takes_synchronized() else {"synchronized": True}  # one model: the same seeds
        model = make_model(x.shape[1:], **asked)
        sync_problem = common.sync_bn_problem(model) if replicated else mirrored_sync_problem(model)
    if problem := common.output_problem(model, x) or args.bn == "sync" and sync_problem:
        fix = "; --bn local or --strategy mirrored take any model" if replicated else ", or give --bn local"
        common.refuse(problem + fix * (problem == sync_problem))
    args.bn_asked = args.bn
    wanted = args.bn if args.bn != "auto" else "sync" if args.batch // n < cli.SYNC_BELOW else "local"
    args.bn = "local" if wanted == "sync" and sync_problem else wanted
    if args.jit and args.bn == "sync":
        common.refuse(
            "--jit compiles each replica alone, and synchronized batch norm all-reduces inside it: give "
            "--bn local (or a --batch of 32 or more a device for --bn auto), or drop --jit"
        )
    whole_gpus = len(tf.config.list_logical_devices("GPU")) == len(tf.config.list_physical_devices("GPU"))
    can_nccl = whole_gpus and all("GPU" in d.upper() for d in devices)
    if args.all_reduce == "nccl" and not can_nccl:
        common.refuse("--all-reduce nccl: NCCL runs on distinct GPUs only, not on these devices; give ring")
    args.nccl, args.bucket_bytes = args.all_reduce in ("auto", "nccl") and can_nccl, int(args.bucket_mb * 2**20)
    said = "NCCL" if args.nccl else "a ring (NCCL runs on distinct GPUs only)" if args.all_reduce != "central" else ""
    print(
        f"{args.strategy}: {n} replicas of {args.batch // n} examples on {devices}; all-reduce: "
        f"{said if args.strategy == 'replicated' else cli.mirrored_said(devices, args.all_reduce)}"
    )
    why_local = sync_problem + "; --strategy mirrored synchronizes any model" * replicated if sync_problem else None
    print(cli.bn_said(args, n, why_local if wanted != args.bn else None))
    print(cli.lr_said(args))
    print(cli.gradients_said(args, model))
    per_epoch = len(x) // args.batch
    if args.steps and not args.check and args.steps > (held := args.epochs * per_epoch):  # --steps stops early only
        epochs = -(-args.steps // per_epoch)
        print(f"--steps {args.steps}: --epochs {args.epochs} hold {held} steps of {args.batch}; it trains {held} "
              f"(give --epochs {epochs} for {args.steps})")  # fmt: skip


# What a checkpoint must have been saved with: the batch its step count counts, and what its optimizer restores
# (Adam's learning rate is one of its variables: another --lr would be said and not used).
RESUMED_AS_SAVED = ("batch", "precision", "warmup", "lr", "scale_lr", "lr_batch")


def main(argv=None):
    args = cli.parse(argv, __doc__.split("\n\n")[0])
    keras.utils.set_random_seed(args.seed)  # the same weights, hence accuracy, on the same machine
    saver = checkpoints.Checkpoints(args.checkpoint)  # refuses a folder it cannot write, before any work
    data = common.load_data(args.data, smallest=4)  # the CNN pools twice by 2
    devices = common.choose_devices(args.devices, args.simulate, want=None)
    plan(args, devices, data)
    if args.check:
        metrics = checks.check(args, devices, data, program=sys.modules[__name__])
    else:
        with cli.precision(args.precision):
            run = build(args, devices, data[0][0].shape[1:])
        saver.restore(run.model, run.optimizer, {k: vars(args)[k] for k in RESUMED_AS_SAVED})
        run.restored()
        metrics = common.stopped_by_a_device(lambda: train(args, run, data, saver), args.timeout)
        if args.baseline or not common.simulated(devices):
            metrics.update(checks.baseline(args, devices, data, program=sys.modules[__name__]))
        if args.breakdown:
            metrics["breakdown"] = checks.breakdown(args, devices, data, program=sys.modules[__name__])
    common.write_json(args.json, {"devices": devices, **{k: vars(args)[k] for k in cli.SAID}, **metrics})
    return 1 if metrics.get("verdict", "ok") != "ok" else 0


if __name__ == "__main__":
    raise SystemExit(main())
