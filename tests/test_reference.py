import numpy as np
import pytest
import tensorflow as tf

from tutorial_lib import reference


class Linear(tf.Module):
    """y = x w, plus a variable that the loss never uses (its gradient is None)."""

    def __init__(self, device):
        super().__init__()
        with tf.device(device):
            self.w = tf.Variable([[1.0], [-1.0]])
            self.unused = tf.Variable(5.0)

    @property
    def trainable_variables(self):
        return (self.w, self.unused)

    def __call__(self, x, training=False):
        del training  # nothing here behaves differently in training
        return x @ self.w

    losses = ()


def squared_error(prediction, y):
    return tf.reduce_mean((prediction - y) ** 2)


X = np.array([[1.0, 2.0], [3.0, 1.0]], np.float32)
Y = np.array([[0.0], [1.0]], np.float32)


def expected_step(learning_rate):
    """The same step by hand: loss mean((Xw - Y)^2), gradient 2/n X^T (Xw - Y)."""
    w = np.array([[1.0], [-1.0]], np.float32)
    residual = X @ w - Y
    return float(np.mean(residual**2)), w - learning_rate * 2 / len(X) * X.T @ residual


def test_sgd_step_is_one_plain_sgd_step_on_the_whole_batch(devs):
    model = Linear(devs[2])
    loss = reference.sgd_step(model, tf.constant(X), tf.constant(Y), 0.1, loss_fn=squared_error)
    expected_loss, expected_w = expected_step(0.1)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-6)  # the loss before the update
    np.testing.assert_allclose(model.w, expected_w, rtol=1e-6)
    assert float(model.unused) == 5.0  # a None gradient leaves its variable alone
    assert model.w.device.endswith("CPU:2")


def test_make_sgd_step_is_the_same_step_as_a_tf_function(devs):
    model = Linear(devs[0])
    step = reference.make_sgd_step(model, 0.1, loss_fn=squared_error)
    assert isinstance(step, tf.types.experimental.PolymorphicFunction)
    expected_loss, expected_w = expected_step(0.1)
    np.testing.assert_allclose(step(tf.constant(X), tf.constant(Y)), expected_loss, rtol=1e-6)
    np.testing.assert_allclose(model.w, expected_w, rtol=1e-6)


def test_loss_and_gradients_does_not_update(devs):
    model = Linear(devs[0])
    loss, (grad_w, grad_unused) = reference.loss_and_gradients(model, X, Y, loss_fn=squared_error)
    np.testing.assert_allclose(loss, expected_step(0.1)[0], rtol=1e-6)
    assert grad_unused is None and grad_w.shape == (2, 1)
    np.testing.assert_array_equal(model.w, [[1.0], [-1.0]])


def test_apply_sgd_updates_each_variable_where_it_lives(devs):
    variables = []
    for d in devs[:2]:
        with tf.device(d):
            variables.append(tf.Variable([1.0, 2.0]))
    reference.apply_sgd(variables, [tf.constant([1.0, 1.0]), tf.constant([0.0, 10.0])], 0.5)
    np.testing.assert_allclose(variables[0], [0.5, 1.5])
    np.testing.assert_allclose(variables[1], [1.0, -3.0])
    assert [v.device[-5:] for v in variables] == [d[-5:] for d in devs[:2]]


@pytest.mark.parametrize("grads", [[tf.constant(1.0)], [tf.constant(1.0)] * 3])
def test_apply_sgd_refuses_a_gradient_list_that_does_not_match(grads):
    variables = [tf.Variable(1.0), tf.Variable(2.0)]
    with pytest.raises(ValueError, match=f"2 variables but {len(grads)} gradients: they pair up one to one"):
        reference.apply_sgd(variables, grads, 0.1)
    assert [float(v) for v in variables] == [1.0, 2.0]  # refused before any update
