"""The course's small models (`MLP`, the NCCL asker's; `cnn_stages`, the pipeline asker's CNN):
explicit, seeded `tf.Variable`s on the device current at creation, and `training`/`losses` as
Keras models have, so that every loop runs Keras models too.
"""

from __future__ import annotations

import contextlib

import keras
import numpy as np
import tensorflow as tf


def _glorot(rng: np.random.Generator, shape, fan_in: int, fan_out: int) -> np.ndarray:
    limit = np.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-limit, limit, size=shape).astype(np.float32)


class _Layer(tf.Module):
    """A layer with a kernel `w` and a bias `b`, listed in that order (tf.Module sorts by name)."""

    def __init__(self, shape, fan_in: int, fan_out: int, seed: int, name):
        super().__init__(name=name)
        with self.name_scope:  # variable names read 'dense0/w:0'
            self.w = tf.Variable(_glorot(np.random.default_rng(seed), shape, fan_in, fan_out), name="w")
            self.b = tf.Variable(tf.zeros([shape[-1]]), name="b")

    @property
    def trainable_variables(self):
        return (self.w, self.b)


class Dense(_Layer):
    def __init__(self, n_in: int, n_out: int, relu: bool = False, seed: int = 0, name=None):
        super().__init__((n_in, n_out), n_in, n_out, seed, name)
        self.relu = relu

    def __call__(self, x):
        y = tf.matmul(x, self.w) + self.b
        return tf.nn.relu(y) if self.relu else y


class Conv2D(_Layer):
    """3x3 'SAME' convolution followed by ReLU."""

    def __init__(self, c_in: int, c_out: int, seed: int = 0, name=None):
        super().__init__((3, 3, c_in, c_out), 9 * c_in, 9 * c_out, seed, name)

    def __call__(self, x):
        return tf.nn.relu(tf.nn.conv2d(x, self.w, strides=1, padding="SAME") + self.b)


class MaxPool(tf.Module):
    def __call__(self, x):
        return tf.nn.max_pool2d(x, ksize=2, strides=2, padding="VALID")


class Flatten(tf.Module):
    def __call__(self, x):
        return tf.reshape(x, [tf.shape(x)[0], -1])


class Sequential(tf.Module):
    """Layers applied in order; its `trainable_variables` and `losses` are theirs.

    Keras layers (and nested `Sequential`s) are called with `training`; other callables with x alone.
    """

    def __init__(self, layers, name=None):
        super().__init__(name=name)
        self.layers = list(layers)

    @property
    def trainable_variables(self):
        return tuple(v for layer in self.layers for v in layer.trainable_variables)

    @property
    def losses(self):
        return [loss for layer in self.layers for loss in getattr(layer, "losses", ())]

    def __call__(self, x, training=None):
        for layer in self.layers:
            x = layer(x, training=training) if isinstance(layer, keras.layers.Layer | Sequential) else layer(x)
        return x


class MLP(Sequential):
    """Flatten, ReLU hidden layers, linear logits: the asker's single layer grown, without its ReLU on the logits."""

    def __init__(self, in_features: int = 64, hidden=(128,), num_classes: int = 10, seed: int = 0):
        sizes = [in_features, *hidden, num_classes]
        layers = [Flatten()]
        for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
            last = i == len(sizes) - 2
            layers.append(Dense(n_in, n_out, relu=not last, seed=seed + i, name=f"dense{i}"))
        super().__init__(layers, name="mlp")


def cnn_stages(input_shape=(8, 8, 1), seed: int = 0, devices=None):
    """The pipeline asker's CNN ('SAME' convolutions for small images, no dropout) as its three
    `tf.device` blocks; with `devices` (three names), stage i is created on devices[i]."""
    height, width, channels = input_shape
    if height < 8 or width < 8:
        raise ValueError(f"the CNN pools three times, so images must be at least 8x8, got {input_shape}.")
    flat = (height // 8) * (width // 8) * 64
    builders = [
        lambda: [Conv2D(channels, 32, seed), Conv2D(32, 64, seed + 1), MaxPool()],
        lambda: [Conv2D(64, 128, seed + 2), MaxPool(), Conv2D(128, 64, seed + 3), MaxPool()],
        lambda: [Flatten(), Dense(flat, 1500, relu=True, seed=seed + 4), Dense(1500, 10, seed=seed + 5)],
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
