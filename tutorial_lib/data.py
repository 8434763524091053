"""The course data: scikit-learn's 8x8 digits (offline), Keras MNIST (online), tf.data pipelines.

Loaders return ``(x_train, y_train), (x_test, y_test)``: float32 images in [0, 1] shaped
(N, H, W, 1), int32 labels.
"""

from __future__ import annotations

import numpy as np

from . import checks


def load_digits(test_fraction: float = 1 / 6, seed: int = 0):
    """scikit-learn's 8x8 digits, split into train and test sets in a fixed, shuffled order."""
    from sklearn.datasets import load_digits as sk_digits

    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must lie in (0, 1), got {test_fraction}.")
    bunch = sk_digits()
    images = bunch.images.astype(np.float32) / 16.0  # pixel values are 0..16
    order = np.random.default_rng(seed).permutation(len(images))
    n_test = round(len(images) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return _prepare(images[train], bunch.target[train]), _prepare(images[test], bunch.target[test])


def load_mnist(path: str = "mnist.npz"):
    """The real MNIST through `keras.datasets.mnist.load_data` (downloads once, then cached)."""
    import keras

    (x_train, y_train), (x_test, y_test) = keras.datasets.mnist.load_data(path=path)
    return _prepare(x_train / 255.0, y_train), _prepare(x_test / 255.0, y_test)


def _prepare(images, labels):
    images = np.asarray(images, dtype=np.float32)[..., np.newaxis]
    return images, np.asarray(labels, dtype=np.int32)


def make_dataset(
    x, y, batch_size: int, shuffle: bool = True, seed: int = 0, repeat: bool = False, drop_remainder: bool = True
):
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
    if repeat:
        ds = ds.repeat()
    return ds.batch(batch_size, drop_remainder=drop_remainder).prefetch(tf.data.AUTOTUNE)


def random_batch(examples: int, shape=(8, 8, 1), classes: int = 10, seed: int = 0):
    """Random images in [0, 1) and labels, as tensors (x float32, y int32)."""
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    x = rng.random((checks.whole_number(examples, "examples"), *shape), dtype=np.float32)
    return tf.constant(x), tf.constant(rng.integers(0, classes, examples, dtype=np.int32))
