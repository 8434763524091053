import numpy as np
import pytest
import tensorflow as tf

from tutorial_lib import data, models, pipeline, reference, staging


@pytest.fixture(scope="module")
def batch():
    (x, y), _ = data.load_digits()
    return tf.reshape(tf.constant(x[:64]), [64, -1]), tf.constant(y[:64])


def two_stages(devices=None):
    """A 2-stage MLP on the digits (flattened), weights seeded, stage s on devices[s]."""
    stages = []
    for s, (n_in, n_out, relu) in enumerate(((64, 32, True), (32, 10, False))):
        with tf.device(devices[s] if devices else "/device:CPU:0"):
            stages.append(models.Sequential([models.Dense(n_in, n_out, relu=relu, seed=s)]))
    return stages


class Guard(tf.Module):
    """A stage that fails at run time on inputs above a limit."""

    trainable_variables = ()

    def __call__(self, h):
        with tf.control_dependencies([tf.debugging.assert_less(tf.reduce_max(h), 10.0, message="too large")]):
            return tf.identity(h)


def staged(devs, M=4, guard=False):
    stages = two_stages(devs[:2])
    if guard:
        stages[1] = models.Sequential([Guard(), stages[1]])
    pipe = pipeline.Pipeline(stages, devs[:2], M, learning_rate=0.5, schedule="1f1b")
    return pipe, staging.StagedInput(pipe)


def batches_of(x, y, size):
    return [(x[i : i + size], y[i : i + size]) for i in range(0, len(x), size)]


def reference_losses(batches):
    single = models.Sequential(two_stages())
    return [float(reference.sgd_step(single, x, y, 0.5)) for x, y in batches]


def test_staged_input_trains_like_the_single_device_steps(devs, batch):
    pipe, feed = staged(devs)
    batches = batches_of(*batch, 16)
    np.testing.assert_allclose(feed.run(batches), reference_losses(batches), atol=1e-5)
    assert feed.size() == 0 and int(pipe.step) == len(batches)  # drained
    assert feed.run([]) == []


def test_a_short_last_batch_that_m_divides_is_trained(devs, batch):
    x, y = batch
    _, feed = staged(devs)
    batches = [(x[:24], y[:24]), (x[24:48], y[24:48]), (x[48:56], y[48:56])]  # 24, 24 and 8 examples
    np.testing.assert_allclose(feed.run(batches), reference_losses(batches), atol=1e-5)


@pytest.mark.slow
def test_a_failed_step_leaves_the_area_empty_keeps_the_losses_and_the_next_run_works(devs, batch):
    pipe, feed = staged(devs, guard=True)
    batches = batches_of(*batch, 16)
    with pytest.raises(tf.errors.InvalidArgumentError, match="too large") as failed:
        feed.run([batches[0], (1e4 * batches[1][0], batches[1][1]), batches[2]])  # fails at step 1
    assert feed.size() == 0  # the batch staged for step 2 is gone: no stale get next time
    assert int(pipe.step) == 1 and len(failed.value.losses) == 1  # step 0 was applied, its loss kept
    refs = reference_losses(batches[:1] + batches)
    np.testing.assert_allclose(failed.value.losses, refs[:1], atol=1e-5)
    np.testing.assert_allclose(feed.run(batches), refs[1:], atol=1e-5)


@pytest.mark.parametrize(
    "bad, error, message",
    [
        (lambda x, y: (tf.cast(x, tf.float64), y), ValueError, "stage 0 cannot take the micro-batch .* float64"),
        (lambda x, y: (x, tf.cast(y, tf.float32)), ValueError, "labels must be integer class ids"),
        (lambda x, y: (x[:10], y[:10]), ValueError, "batch of 10 examples .* does not split into 4"),
        (lambda x, y: {"image": x, "label": y}, TypeError, r"batch 0 is a dict, not an \(x, y\) pair.*dataset.map"),
    ],
)
def test_a_bad_first_batch_gets_its_own_error_before_anything_is_staged(devs, batch, bad, error, message):
    pipe, feed = staged(devs)
    with pytest.raises(error, match=message):
        feed.run([bad(*batch), batch])
    assert feed.size() == 0 and int(pipe.step) == 0


def test_a_list_whose_last_batch_m_does_not_divide_is_refused_before_any_step(devs, batch):
    x, y = batch
    pipe, feed = staged(devs)
    with pytest.raises(ValueError, match="batch of 6 examples .* drop_remainder=True"):
        feed.run([(x[:16], y[:16]), (x[16:32], y[16:32]), (x[32:38], y[32:38])])
    assert int(pipe.step) == 0


def test_from_an_iterator_every_batch_before_a_bad_one_is_trained(devs, batch):
    x, y = batch
    pipe, feed = staged(devs)
    good = [(x[:16], y[:16]), (x[16:32], y[16:32])]
    with pytest.raises(ValueError, match="batch of 6 examples") as failed:
        feed.run(iter([*good, (x[32:38], y[32:38])]))
    assert int(pipe.step) == 2 and feed.size() == 0  # the batch staged before the bad one was trained too
    np.testing.assert_allclose(failed.value.losses, reference_losses(good), atol=1e-5)


def test_a_dataset_is_fed_when_its_batches_have_a_fixed_size(devs, batch):
    x, y = batch
    pipe, feed = staged(devs)
    loose = tf.data.Dataset.from_tensor_slices((x[:40], y[:40])).batch(16)
    with pytest.raises(ValueError, match="no fixed size.*drop_remainder=True"):
        feed.run(loose)
    assert int(pipe.step) == 0
    fixed = tf.data.Dataset.from_tensor_slices((x[:40], y[:40])).batch(16, drop_remainder=True)
    np.testing.assert_allclose(feed.run(fixed), reference_losses(batches_of(x[:32], y[:32], 16)), atol=1e-5)


def test_staged_input_refuses_a_tf_function_and_other_dtypes_or_shapes(devs, batch):
    x, y = batch
    _, feed = staged(devs)
    with pytest.raises(RuntimeError, match="cannot be traced into a tf.function"):
        tf.function(lambda: feed.run([(x, y)]))()
    with pytest.raises(ValueError, match="batch 1 has dtypes and shapes float32 \\[None, 64\\], int64"):
        feed.run([(x[:16], y[:16]), (x[16:32], tf.cast(y[16:32], tf.int64))])
    assert feed.size() == 0
