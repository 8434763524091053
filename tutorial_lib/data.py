"""The course data: the 8x8 digits (offline) and tf.data pipelines."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from . import checks

# 1,797 8x8 handwritten digits, 64 pixels of 0..16 and the label per row: the test part of UCI's
# Optical Recognition of Handwritten Digits (Alpaydin and Kaynak, 1998; CC BY 4.0), copied from
# scikit-learn's datasets/data/digits.csv.gz, byte for byte. Bundled, not imported from
# scikit-learn: Keras imports scikit-learn whenever it is installed, about 2 s of CPU at every
# TensorFlow start.
DIGITS = Path(__file__).with_name("digits.csv.gz")


def load_digits(seed: int = 0):
    """The 8x8 digits as ``(x_train, y_train), (x_test, y_test)`` in a fixed, shuffled order, one
    in six for testing: float32 images in [0, 1] shaped (N, 8, 8, 1), int32 labels."""
    table = np.loadtxt(DIGITS, delimiter=",")
    images = table[:, :64].reshape(-1, 8, 8, 1).astype(np.float32) / 16.0  # pixel values are 0..16
    labels = table[:, 64].astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(images))
    test, train = np.split(order, [round(len(images) / 6)])
    return (images[train], labels[train]), (images[test], labels[test])


def make_dataset(x, y, batch_size: int, shuffle: bool = True, seed: int = 0, drop_remainder: bool = True):
    """A tf.data pipeline of (images, labels) batches: shuffled, batched, prefetched. Keep
    `drop_remainder=True` for training (batches that split evenly across devices)."""
    import tensorflow as tf

    batch_size = checks.whole_number(batch_size, "batch_size")
    if drop_remainder and batch_size > len(x):
        raise ValueError(
            f"batch_size {batch_size} is larger than the {len(x)} examples, so "
            "drop_remainder=True would leave no batch at all. Use a smaller batch."
        )
    ds = tf.data.Dataset.from_tensor_slices((x, y))
    if shuffle:
        ds = ds.shuffle(len(x), seed=seed, reshuffle_each_iteration=True)
    return ds.batch(batch_size, drop_remainder=drop_remainder).prefetch(tf.data.AUTOTUNE)


def random_batch(examples: int, seed: int = 0):
    """Random 8x8 images in [0, 1) and labels of 10 classes, as tensors (x float32, y int32)."""
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    x = rng.random((checks.whole_number(examples, "examples"), 8, 8, 1), dtype=np.float32)
    return tf.constant(x), tf.constant(rng.integers(0, 10, examples, dtype=np.int32))
