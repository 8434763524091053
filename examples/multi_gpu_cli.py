"""train_multi_gpu.py's command line: its arguments, what it refuses before any work, the learning rate of a
grown batch, and the lines that say what a run will do. Nothing here trains.
"""

import argparse
import contextlib
import importlib.util
from pathlib import Path

import common  # noqa: F401 (TensorFlow, quietly)
import data_parallel as dp
import keras
import numpy as np
import tensorflow as tf

SYNC_BELOW = 32  # --bn auto: synchronized below this many examples a device, where a share's statistics are noisy
SCALINGS = {"none": lambda _: 1.0, "linear": lambda ratio: ratio, "sqrt": lambda ratio: ratio**0.5}
SAID = ("strategy", "bn", "precision", "jit", "bucket_mb", "steps_per_call", "batch")  # written to --json


def parse(argv, description):
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--devices", help="comma-separated device names (default: every GPU, if 2 or more)")
    p.add_argument("--simulate", type=int, metavar="N", help="N logical CPU devices (default without 2 GPUs: 2)")
    p.add_argument(
        "--strategy",
        choices=("replicated", "mirrored"),
        default="replicated",
        help="replicated: data_parallel.py's step; mirrored: MirroredStrategy",
    )
    p.add_argument(
        "--all-reduce",
        choices=("auto", "nccl", "ring", "central"),
        default="auto",
        help="auto: NCCL on distinct GPUs, else a ring; central: mirrored's ReductionToOneDevice",
    )
    p.add_argument(
        "--bn",
        choices=("auto", "sync", "local"),
        default="auto",
        help=f"batch norm over the whole batch (sync: an all-reduce per BN layer each way) or each "
        f"device's share (local); auto: sync below {SYNC_BELOW} examples a device if the model allows",
    )
    p.add_argument(
        "--bucket-mb",
        type=float,
        default=25.0,
        help="gradients summed in buckets of this many MB, last "
        "layers first (25: PyTorch DDP's); 0: one all-reduce per gradient",
    )
    p.add_argument(
        "--precision",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="16-bit: Keras' mixed precision (float32 weights); float16 with loss scaling",
    )
    p.add_argument(
        "--jit",
        action="store_true",
        help="each replica's forward and backward compiled by XLA into one "
        "call on its device (needs --bn local); measure it on your GPUs (--baseline)",
    )
    p.add_argument(
        "--steps-per-call",
        type=int,
        default=10,
        metavar="K",
        help="K steps in one call: the host dispatches ahead, and reads the loss once per call",
    )
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch", type=int, default=128, help="the global batch, a multiple of the device count")
    p.add_argument("--steps", type=int, help="stop after this many steps (with --check: compare so many; 20)")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam's learning rate, tuned for --lr-batch")
    p.add_argument(
        "--scale-lr",
        choices=tuple(SCALINGS),
        default="none",
        help="scale --lr from --lr-batch to --batch: linear (Goyal et al. 2017) or sqrt",
    )
    p.add_argument("--lr-batch", type=int, default=128, metavar="B", help="the global batch --lr was tuned for")
    p.add_argument("--warmup", type=int, default=0, metavar="STEPS", help="grow the rate from --lr to the scaled one")
    p.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds an all-reduce waits for every device, then "
        "the run stops (exit 3); the replicated route (MirroredStrategy takes no such option)",
    )
    p.add_argument("--data", help="digits, or an .npz of x_train, y_train, x_test, y_test (default: Keras' MNIST)")
    p.add_argument("--seed", type=int, default=0, help="seeds the initial weights and the batches' order")
    p.add_argument("--check", action="store_true", help="compare with one device (float64); exit 1 if they differ")
    p.add_argument("--baseline", action="store_true", help="and time a plain one-device step: the efficiency")
    p.add_argument("--breakdown", action="store_true", help="and split a step into input, compute and all-reduce")
    p.add_argument("--checkpoint", metavar="DIR", help="save each epoch; resume from DIR's newest intact checkpoint")
    p.add_argument("--json", metavar="PATH", help="write the final metrics to PATH")
    p.add_argument("--logdir", help="TensorBoard scalars here each epoch (and --profile's trace)")
    p.add_argument("--profile", action="store_true", help="a profiler trace of 3 steps in --logdir")
    args = p.parse_args(argv)
    for message in problems(args)[:1]:
        p.error(message)
    args.steps = args.steps or (20 if args.check else None)
    return args


def problems(a):
    """What is wrong with the arguments alone, each with its fix (the first one is said)."""
    n = len(a.devices.split(",")) if a.devices else a.simulate or 2  # every GPU may be more: checked again later
    finite = lambda v, low: low <= v < 1e6  # noqa: E731 (1e6: no finite float above it is a sane value here)
    found = [
        (a.devices and a.simulate, "give --devices or --simulate, not both"),
        (a.simulate is not None and not 1 <= a.simulate <= 16, "--simulate: 1 to 16 devices"),
        (
            min(a.epochs, a.batch, a.steps_per_call, 1 if a.steps is None else a.steps) < 1,
            "--epochs, --batch, --steps and --steps-per-call must be >= 1",
        ),
        (a.batch % n, f"--batch {a.batch}: give a multiple of the {n} devices, e.g. {max(n, a.batch // n * n)}"),
        (not 0 < a.lr < float("inf"), f"--lr {a.lr}: give a positive learning rate, e.g. 1e-3"),
        (not finite(a.bucket_mb, 0), f"--bucket-mb {a.bucket_mb}: give 0 to 1e6 MB (0: one all-reduce per gradient)"),
        (not finite(a.timeout, 1), f"--timeout {a.timeout}: give 1 to 1e6 seconds"),
        (a.lr_batch < 1, f"--lr-batch {a.lr_batch}: give the global batch --lr was tuned for, e.g. 128"),
        (a.warmup < 0, f"--warmup {a.warmup}: give 0 or more steps"),
        (
            a.warmup and np.isclose(scaled_lr(a), a.lr),
            f"--warmup grows the learning rate from --lr to the scaled one, "
            f"here both {a.lr:g}: give --scale-lr linear or sqrt and a --batch other than --lr-batch, or drop --warmup",
        ),
        (
            a.breakdown and a.strategy == "mirrored",
            "--breakdown times steps without their all-reduce, which "
            "MirroredStrategy runs inside apply_gradients: give --strategy replicated, or --profile --logdir DIR",
        ),
        (
            a.check and (a.checkpoint or a.baseline or a.breakdown),
            "--check trains fresh copies and compares them; "
            "--checkpoint, --baseline and --breakdown go with a training run: drop one side",
        ),
        (
            a.precision == "float16" and a.strategy == "mirrored",
            "--precision float16 needs loss scaling, which the "
            "mirrored step does not do: give --precision bfloat16, or --strategy replicated",
        ),
        (a.baseline and n < 2, "--baseline compares with one device: give 2 or more devices"),
        (a.profile and not a.logdir, "--profile writes into --logdir: give --logdir DIR too"),
        (a.logdir and not importlib.util.find_spec("tensorboard"), "--logdir: pip install tensorboard first"),
        (a.data not in (None, "digits") and not Path(a.data or "").is_file(), f"--data {a.data}: no such file"),
        (a.json and not Path(a.json).absolute().parent.is_dir(), f"--json {a.json}: no such folder"),
        (a.json and Path(a.json).is_dir(), f"--json {a.json}: a folder; give a file in it, e.g. {a.json}/m.json"),
        (a.logdir and Path(a.logdir).is_file(), f"--logdir {a.logdir}: a file, not a folder; give a folder"),
        (a.checkpoint and Path(a.checkpoint).is_file(), f"--checkpoint {a.checkpoint}: a file; give a folder"),
    ]
    return [message for problem, message in found if problem]


def scaled_lr(args):
    """--lr, tuned for a global batch of --lr-batch, scaled for --batch: linear (Goyal et al. 2017, "when the
    minibatch size is multiplied by k, multiply the learning rate by k"), sqrt (Krizhevsky 2014), or none."""
    return args.lr * SCALINGS[args.scale_lr](args.batch / args.lr_batch)


def learning_rate(args):
    """scaled_lr; with --warmup W, a schedule of the optimizer's step count that grows linearly from --lr to
    scaled_lr over W steps, then stays (Keras' CosineDecay with alpha=1: no decay). A checkpoint saves the step
    count, so a resumed run goes on where it stopped."""
    if not args.warmup:
        return scaled_lr(args)
    return keras.optimizers.schedules.CosineDecay(
        args.lr, decay_steps=1, alpha=1.0, warmup_target=scaled_lr(args), warmup_steps=args.warmup
    )


def optimizer(args, inner=None, initial_scale=2.0**15):
    """Adam at the run's learning rate (or `inner`); under float16 inside Keras' LossScaleOptimizer (float16's
    small gradients would underflow), which skips a step whose gradients overflowed and lowers its scale."""
    inner = inner or keras.optimizers.Adam(learning_rate(args))
    if args.precision == "float16":
        return keras.optimizers.LossScaleOptimizer(inner, initial_scale=initial_scale)
    return inner


@contextlib.contextmanager
def precision(name):
    """Keras' floatx and dtype policy for the models built inside: "float64" (--check), "float32", or 16-bit
    ("bfloat16", "float16": Keras' mixed precision, float32 variables, 16-bit compute)."""
    floatx, policy = keras.config.floatx(), keras.config.dtype_policy()
    keras.config.set_floatx("float64" if name == "float64" else "float32")
    keras.config.set_dtype_policy(f"mixed_{name}" if name in ("bfloat16", "float16") else name)
    try:
        yield
    finally:
        keras.config.set_floatx(floatx)
        keras.config.set_dtype_policy(policy)


def bn_said(args, n, why_local=None):
    why = f" (auto: sync below {SYNC_BELOW} examples a device, where a share's statistics get noisy)"
    why = f" (auto would synchronize, but {why_local})" if why_local else why
    if args.bn == "sync":
        return f"batch norm: synchronized, the statistics of all {args.batch} examples{why * (args.bn_asked == 'auto')}"
    return f"batch norm: local, each replica its own {args.batch // n} examples{why * (args.bn_asked == 'auto')}"


def lr_said(args):
    said = {"none": "not scaled", "linear": "scaled linearly", "sqrt": "scaled by the square root of the ratio"}
    line = f"learning rate: {args.lr:g} tuned for batch {args.lr_batch}, {said[args.scale_lr]}"
    line += f" to {scaled_lr(args):g}" * (args.scale_lr != "none") + f" for batch {args.batch}"
    return line + f", warmed up over {args.warmup} steps from {args.lr:g}" * bool(args.warmup)


def gradients_said(args, model):
    """How the gradients will be summed: how many buckets of how many bytes, in how many calls a step."""
    if args.strategy == "mirrored":
        return "gradients: summed inside MirroredStrategy's apply_gradients"
    weights = model.trainable_variables
    plan = dp.bucket_plan(weights, args.bucket_bytes)
    sizes = [sum(weights[j].shape.num_elements() * dp.summed_dtype(weights[j]).size for j in bucket) for bucket in plan]
    return (
        f"gradients: {len(weights)} tensors, {sum(sizes):,} bytes, in {len(plan)} all-reduce(s) a step "
        f"(--bucket-mb {args.bucket_mb:g}, last layers first); {args.steps_per_call} steps a call"
    )


def mirrored_said(devices, choice):
    """What MirroredStrategy will sum with, as tf.distribute picks it (mirrored_strategy.py)."""
    if choice == "central":
        return "ReductionToOneDevice, through the first device"
    gpus = [d for d in devices if "GPU" in d.upper()]
    if gpus and len(gpus) < len(devices):
        return "TensorFlow's default for a mix of CPUs and GPUs: ReductionToOneDevice"
    logical = len(tf.config.list_logical_devices("GPU")) > len(tf.config.list_physical_devices("GPU"))
    how = "ring (CPUs)" if not gpus else "ring (logical GPUs)" if logical else "NCCL (whole GPUs)"
    return f"TensorFlow's default, CollectiveAllReduce: {how}"
