"""The course's small models, written with explicit `tf.Variable`s.

Explicit variables (rather than Keras layers that build lazily) make placement visible:
a variable lives on the device that was current when it was created, and towers can
share one set of variables simply by calling the same module. Every initial value comes
from a seeded NumPy generator, so a model is the same on every machine and device.

- `MLP`: the course's network for seed 1 (flatten, hidden ReLU layers, linear logits). The
  seed's own model is a single layer with a ReLU on its logits; notebook 02 says what
  changed and why.
- `cnn_stages`: the seed-2 CNN as three stages, to be placed on three devices. It is
  adapted to small images with 'SAME' convolutions; its dropout layers are left out so
  that parallel and sequential runs can be compared exactly.
"""

from __future__ import annotations

import contextlib

import numpy as np
import tensorflow as tf


def _glorot(rng: np.random.Generator, shape, fan_in: int, fan_out: int) -> np.ndarray:
    limit = np.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-limit, limit, size=shape).astype(np.float32)


class _Layer(tf.Module):
    """A layer with a kernel `w` and a bias `b`, listed in that order (tf.Module sorts by name)."""

    @property
    def trainable_variables(self):
        return (self.w, self.b)


class Dense(_Layer):
    def __init__(self, n_in: int, n_out: int, relu: bool = False, seed: int = 0, name=None):
        super().__init__(name=name)
        rng = np.random.default_rng(seed)
        with self.name_scope:  # variable names read 'dense0/w:0'
            self.w = tf.Variable(_glorot(rng, (n_in, n_out), n_in, n_out), name="w")
            self.b = tf.Variable(tf.zeros([n_out]), name="b")
        self.relu = relu

    def __call__(self, x):
        y = tf.matmul(x, self.w) + self.b
        return tf.nn.relu(y) if self.relu else y


class Conv2D(_Layer):
    """3x3 'SAME' convolution followed by ReLU."""

    def __init__(self, c_in: int, c_out: int, seed: int = 0, name=None):
        super().__init__(name=name)
        rng = np.random.default_rng(seed)
        shape = (3, 3, c_in, c_out)
        with self.name_scope:
            self.w = tf.Variable(_glorot(rng, shape, 9 * c_in, 9 * c_out), name="w")
            self.b = tf.Variable(tf.zeros([c_out]), name="b")

    def __call__(self, x):
        return tf.nn.relu(tf.nn.conv2d(x, self.w, strides=1, padding="SAME") + self.b)


class MaxPool(tf.Module):
    def __call__(self, x):
        return tf.nn.max_pool2d(x, ksize=2, strides=2, padding="VALID")


class Flatten(tf.Module):
    def __call__(self, x):
        return tf.reshape(x, [tf.shape(x)[0], -1])


class Sequential(tf.Module):
    """Layers applied in order; its `trainable_variables` are theirs."""

    def __init__(self, layers, name=None):
        super().__init__(name=name)
        self.layers = list(layers)

    @property
    def trainable_variables(self):
        return tuple(v for layer in self.layers for v in layer.trainable_variables)

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class MLP(Sequential):
    """Flatten, ReLU hidden layers, linear logits: seed 1's single layer grown, without its ReLU on the logits."""

    def __init__(self, in_features: int = 64, hidden=(128,), num_classes: int = 10, seed: int = 0):
        sizes = [in_features, *hidden, num_classes]
        layers = [Flatten()]
        for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
            last = i == len(sizes) - 2
            layers.append(Dense(n_in, n_out, relu=not last, seed=seed + i, name=f"dense{i}"))
        super().__init__(layers, name="mlp")


def cnn_stages(input_shape=(8, 8, 1), num_classes: int = 10, seed: int = 0, devices=None):
    """The seed-2 CNN split into its three `tf.device` blocks, as three `Sequential`s.

    With `devices` (three names), stage i and its variables are created on devices[i].
    """
    height, width, channels = input_shape
    if height < 8 or width < 8:
        raise ValueError(f"the CNN pools three times, so images must be at least 8x8, got {input_shape}.")
    flat = (height // 8) * (width // 8) * 64
    builders = [
        lambda: [Conv2D(channels, 32, seed), Conv2D(32, 64, seed + 1), MaxPool()],
        lambda: [Conv2D(64, 128, seed + 2), MaxPool(), Conv2D(128, 64, seed + 3), MaxPool()],
        lambda: [Flatten(), Dense(flat, 1500, relu=True, seed=seed + 4), Dense(1500, num_classes, seed=seed + 5)],
    ]
    if devices is not None and len(devices) != len(builders):
        raise ValueError(f"the CNN has {len(builders)} stages but {len(devices)} devices were given.")
    stages = []
    for i, build in enumerate(builders):
        with tf.device(devices[i]) if devices else contextlib.nullcontext():
            stages.append(Sequential(build(), name=f"stage{i}"))
    return stages


def cross_entropy(logits, labels):
    """Mean softmax cross-entropy of integer labels."""
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))


def accuracy(logits, labels) -> tf.Tensor:
    """Fraction of examples whose largest logit is the true label."""
    hits = tf.equal(tf.argmax(logits, axis=-1, output_type=tf.int32), tf.cast(labels, tf.int32))
    return tf.reduce_mean(tf.cast(hits, tf.float32))
