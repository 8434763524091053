"""Notebook 03's custom training loop under `MultiWorkerMirroredStrategy`, one copy per worker.

    python -m tutorial_lib.multi_worker --steps 40 --out runs/demo   (each with its TF_CONFIG)

Each worker reads its shard of the digits; the chief checkpoints into the real directory, the
others into temporary ones they delete; a restarted job resumes where its checkpoint was
taken. `--crash-at` and `--crash-worker` make one worker die abruptly, for the fault drill.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

HIDDEN, LEARNING_RATE = (64,), 0.5
COLLECTIVE_TIMEOUT_S = 15.0  # how long a worker waits for a dead peer before failing (the fault drill)


def shard_dataset(worker: int, workers: int, batch: int, seed: int = 0):
    """Worker `worker`'s endless stream of batches: every workers-th digit, in a fixed order."""
    import tensorflow as tf

    from . import data

    (x, y), _ = data.load_digits(seed=seed)
    return tf.data.Dataset.from_tensor_slices((x, y)).shard(workers, worker).repeat().batch(batch, drop_remainder=True)


def reference_weights(workers: int, batch: int, steps: int):
    """What the job must end with: the same global batches, trained on one device in one process."""
    import tensorflow as tf

    from . import models, reference

    model = models.MLP(hidden=HIDDEN)
    streams = [iter(shard_dataset(w, workers, batch)) for w in range(workers)]
    step = reference.make_sgd_step(model, LEARNING_RATE)
    for _ in range(steps):
        parts = [next(s) for s in streams]
        step(tf.concat([p[0] for p in parts], 0), tf.concat([p[1] for p in parts], 0))
    return [v.numpy() for v in model.trainable_variables]


def is_chief(resolver) -> bool:
    """The chief writes the step log, the weights and the real checkpoints: the "chief" task if
    the cluster has one, else worker 0, and a job started without `TF_CONFIG` (one worker)."""
    if resolver.task_type is None or resolver.task_type == "chief":
        return True
    return resolver.task_type == "worker" and resolver.task_id == 0 and "chief" not in resolver.cluster_spec().jobs


def checkpoint_dir(base: str, resolver) -> str:
    """Chief: the real directory. Others: a temporary one of their own (deleted after saving)."""
    return base if is_chief(resolver) else os.path.join(base, f"tmp_worker{resolver.task_id}")


def _crash_drill(strategy, me: int, crash_worker: int, k: int) -> None:
    """Once every worker has finished step k (and the chief has logged it), one worker dies."""
    import tensorflow as tf

    @tf.function
    def barrier():
        return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(lambda: tf.constant(1.0)), axis=None)

    barrier()
    if crash_worker == me:
        print(f"worker {me}: crashing after step {k}", flush=True)
        os._exit(3)  # abrupt, like a lost machine: no cleanup, no checkpoint


def train(args) -> int:
    import numpy as np
    import tensorflow as tf

    from . import models
    from .strategy import mirrored_train_step

    # One single-core CPU per worker, like devices.simulate(1); simulate itself would start
    # TensorFlow's runtime, which the strategy must configure first.
    tf.config.threading.set_intra_op_parallelism_threads(1)
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=COLLECTIVE_TIMEOUT_S)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    resolver = strategy.cluster_resolver  # without TF_CONFIG: a one-worker job, task None
    workers, me, chief = strategy.num_replicas_in_sync, resolver.task_id or 0, is_chief(resolver)

    with strategy.scope():
        model = models.MLP(hidden=HIDDEN)
        optimizer = tf.keras.optimizers.SGD(LEARNING_RATE)
        step = tf.Variable(0, dtype=tf.int64, trainable=False)
    checkpoint = tf.train.Checkpoint(model=model, step=step)
    saved = os.path.join(args.out, "checkpoints")
    target = checkpoint_dir(saved, resolver)
    manager = tf.train.CheckpointManager(checkpoint, target, max_to_keep=2)
    # Every worker restores the chief's checkpoint: the only complete one.
    latest = tf.train.latest_checkpoint(saved)
    if latest:
        checkpoint.restore(latest)
    start = int(step.numpy())
    began = f"resumed from checkpoint at step {start}" if latest else "fresh start"
    print(f"worker {me}/{workers}: {began}", flush=True)
    if start >= args.steps:
        done = f"the job is complete (checkpoint at step {start}, --steps {args.steps}); nothing to do"
        print(f"worker {me}: {done}", flush=True)
        return 0

    def dataset_fn(context):
        ds = shard_dataset(context.input_pipeline_id, context.num_input_pipelines, args.batch)
        return ds.skip(start)  # the batches consumed before the checkpoint

    batches = iter(strategy.distribute_datasets_from_function(dataset_fn))

    train_step = mirrored_train_step(strategy, model, optimizer)  # notebook 03's step

    # Only the chief keeps a step log; the others write theirs to nowhere.
    with open(os.path.join(args.out, "steps.jsonl") if chief else os.devnull, "a") as log:
        for k in range(start + 1, args.steps + 1):
            loss = float(train_step(batches, tf.constant(1)))  # one step a call: a crash or a save may follow
            step.assign(k)
            log.write(json.dumps({"step": k, "loss": round(loss, 6)}) + "\n")
            log.flush()
            if args.crash_at == k:
                _crash_drill(strategy, me, args.crash_worker, k)
            if k % args.checkpoint_every == 0 or k == args.steps:
                manager.save(checkpoint_number=k)  # every worker saves: the save is collective
                if not chief:
                    shutil.rmtree(target, ignore_errors=True)
    if chief:
        np.savez(os.path.join(args.out, "weights.npz"), *[v.numpy() for v in model.trainable_variables])
        print(f"worker {me}: done at step {args.steps}, loss {loss:.4f}", flush=True)
    return 0


def tf_config_problem(text: str | None) -> str | None:
    """What is wrong with a `TF_CONFIG` value (None if nothing, or if it is unset: one worker)."""
    if not text:
        return None
    fix = 'set it to JSON such as {"cluster": {"worker": ["localhost:2222"]}, "task": {"type": "worker", "index": 0}}'
    try:
        config = json.loads(text)
        tasks = config.get("cluster", {}).get(config["task"]["type"], [])
        index = config["task"]["index"]
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        return f"TF_CONFIG is not a cluster and a task ({type(err).__name__}: {err}); {fix}, or unset it"
    if not isinstance(index, int) or not 0 <= index < len(tasks):
        return (
            f"TF_CONFIG's task index {index!r} is outside its {len(tasks)} {config['task']['type']!r} task(s): "
            f"give an index from 0 to {len(tasks) - 1}"
        )
    return None


def _workers(text: str | None) -> int:
    """How many workers a valid `TF_CONFIG` describes (chief included); 1 without one."""
    cluster = json.loads(text)["cluster"] if text else {}
    return len(cluster.get("chief", [])) + len(cluster.get("worker", [])) or 1


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=32, help="examples per worker and step")
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--out", required=True, help="folder for the step log, weights and checkpoints")
    parser.add_argument("--crash-at", type=int, default=None, help="step after which --crash-worker dies")
    parser.add_argument("--crash-worker", type=int, default=1, help="index of the worker that dies at --crash-at")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch < 1 or args.checkpoint_every < 1:
        parser.error("--steps, --batch and --checkpoint-every must be >= 1")
    if args.crash_worker < 0:
        parser.error(f"--crash-worker must be a worker index >= 0 (0 is the chief), got {args.crash_worker}")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        parser.error(f"--out {args.out!r} is a file, not a folder: give the path of a folder (new or existing)")
    problem = tf_config_problem(os.environ.get("TF_CONFIG"))
    if problem:
        parser.error(problem)
    workers = _workers(os.environ.get("TF_CONFIG"))
    if args.crash_at is not None and args.crash_worker >= workers:
        parser.error(
            f"--crash-worker {args.crash_worker} is not a worker of this {workers}-worker job; "
            f"give a worker index from 0 to {workers - 1}."
        )
    os.makedirs(args.out, exist_ok=True)
    return args


if __name__ == "__main__":
    from .core_worker import skip_plotting_imports

    skip_plotting_imports()  # a worker never plots
    sys.exit(train(parse()))
