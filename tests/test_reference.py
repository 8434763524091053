import numpy as np
import tensorflow as tf

from tutorial_lib import reference


class Linear(tf.Module):
    """logits = x w, plus a variable that the loss never uses (its gradient is None)."""

    def __init__(self, device):
        super().__init__()
        with tf.device(device):
            self.w = tf.Variable([[1.0, 0.0], [-1.0, 0.5]])
            self.unused = tf.Variable(5.0)

    @property
    def trainable_variables(self):
        return (self.w, self.unused)

    def __call__(self, x, training=False):
        del training  # nothing here behaves differently in training
        return x @ self.w

    losses = ()


X = np.array([[1.0, 2.0], [3.0, 1.0]], np.float32)
Y = np.array([0, 1], np.int32)


def expected_step(learning_rate):
    """The same step by hand: softmax cross-entropy, gradient X^T (softmax(Xw) - onehot(Y)) / n."""
    w = np.array([[1.0, 0.0], [-1.0, 0.5]], np.float32)
    logits = X @ w
    p = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    loss = -np.mean(np.log(p[np.arange(len(Y)), Y]))
    return float(loss), w - learning_rate * X.T @ (p - np.eye(2)[Y]) / len(X)


def test_sgd_step_is_one_plain_sgd_step_on_the_whole_batch(devs):
    model = Linear(devs[2])
    loss = reference.sgd_step(model, tf.constant(X), tf.constant(Y), 0.1)
    expected_loss, expected_w = expected_step(0.1)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-6)  # the loss before the update
    np.testing.assert_allclose(model.w, expected_w, rtol=1e-6)
    assert float(model.unused) == 5.0  # a None gradient leaves its variable alone
    assert model.w.device.endswith("CPU:2")


def test_make_sgd_step_is_the_same_step_as_a_tf_function(devs):
    model = Linear(devs[0])
    step = reference.make_sgd_step(model, 0.1)
    assert isinstance(step, tf.types.experimental.PolymorphicFunction)
    expected_loss, expected_w = expected_step(0.1)
    np.testing.assert_allclose(step(tf.constant(X), tf.constant(Y)), expected_loss, rtol=1e-6)
    np.testing.assert_allclose(model.w, expected_w, rtol=1e-6)


def test_loss_and_gradients_does_not_update(devs):
    model = Linear(devs[0])
    loss, (grad_w, grad_unused) = reference.loss_and_gradients(model, X, Y)
    np.testing.assert_allclose(loss, expected_step(0.1)[0], rtol=1e-6)
    assert grad_unused is None and grad_w.shape == (2, 2)
    np.testing.assert_array_equal(model.w, [[1.0, 0.0], [-1.0, 0.5]])
