import numpy as np
import pytest
import tensorflow as tf

from tutorial_lib import data, models, pipeline, reference, timeline


@pytest.fixture(scope="module")
def batch():
    (x, y), _ = data.load_digits()
    return tf.constant(x[:64]), tf.constant(y[:64])


def test_bubble_fraction():
    assert pipeline.bubble_fraction(1, 8) == 0
    assert pipeline.bubble_fraction(2, 8) == pytest.approx(1 / 9)
    assert pipeline.bubble_fraction(4, 4) == pytest.approx(3 / 7)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="stages must be a whole number"):
            pipeline.bubble_fraction(bad, 4)
        with pytest.raises(ValueError, match="micro_batches must be a whole number"):
            pipeline.schedule(2, bad)


def test_numpy_integers_are_whole_numbers():
    assert pipeline.bubble_fraction(np.int64(2), np.int64(8)) == pytest.approx(1 / 9)
    assert pipeline.schedule(np.int64(2), np.int32(2)) == pipeline.schedule(2, 2)


def test_gpipe_schedule_for_two_stages():
    f, b = frozenset, frozenset()
    assert pipeline.schedule(2, 2, "gpipe") == [
        (f({0}), b),
        (f({0, 1}), b),
        (f({1}), b),  # forwards: a wave down the stages
        (b, f({1})),
        (b, f({0, 1})),
        (b, f({0})),  # backwards: a wave back up
    ]


@pytest.mark.parametrize("kind", pipeline.SCHEDULES)
@pytest.mark.parametrize("stages, micro_batches", [(1, 3), (2, 4), (3, 2), (4, 8)])
def test_every_schedule_runs_each_forward_and_backward_once(kind, stages, micro_batches):
    ticks = pipeline.schedule(stages, micro_batches, kind)
    for s in range(stages):
        assert sum(s in f for f, _ in ticks) == micro_batches
        assert sum(s in b for _, b in ticks) == micro_batches
    expected = {
        "sequential": 2 * stages * micro_batches,
        "gpipe": 2 * (micro_batches + stages - 1),
        "1f1b": micro_batches + 2 * stages - 2,
    }
    assert len(ticks) == expected[kind]


def test_schedule_rejects_unknown_kind():
    with pytest.raises(ValueError, match="schedule must be one of"):
        pipeline.schedule(2, 2, "zigzag")


def _reference(stages, x, y):
    """The whole model on the whole batch, not pipelined: the single-device reference."""
    loss, grads = reference.loss_and_gradients(models.Sequential(stages), x, y)
    return float(loss), [g.numpy() for g in grads]


def test_sequential_gradients_equal_the_reference(devs, batch):
    x, y = batch
    stages = models.cnn_stages(devices=devs[:3], seed=5)
    ref_loss, ref_grads = _reference(stages, x, y)
    loss, grads = pipeline.sequential_gradients(stages, devs[:3], x, y)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for g, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kind", pipeline.SCHEDULES)
def test_pipelined_gradients_and_step_equal_the_sequential_step(devs, batch, kind):
    x, y = batch
    stages = models.cnn_stages(devices=devs[:3], seed=5)
    ref_loss, ref_grads = _reference(stages, x, y)
    pipe = pipeline.Pipeline(stages, devs[:3], micro_batches=4, learning_rate=0.1, schedule_kind=kind)
    loss, grads = pipe.gradients(x, y)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for g, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6)
    single = models.Sequential(models.cnn_stages(seed=5))  # the same weights, on one device
    before = [v.numpy() for v in single.trainable_variables]
    np.testing.assert_allclose(pipe.train_step(x, y), reference.sgd_step(single, x, y, 0.1), rtol=1e-5)
    after = [v.numpy() for s in stages for v in s.trainable_variables]
    for a, b, w in zip(after, single.trainable_variables, before, strict=True):
        np.testing.assert_allclose(a - w, b.numpy() - w, rtol=1e-3, atol=1e-7)  # the updates themselves
    assert all(buffer.count == 0 and buffer.size() == 0 for buffer in pipe.buffers())


def test_stash_profile_measures_the_memory_of_each_schedule(devs, batch):
    x, y = batch
    stages = models.cnn_stages(devices=devs[:3])
    peaks = {}
    for kind in pipeline.SCHEDULES:
        pipe = pipeline.Pipeline(stages, devs[:3], micro_batches=8, learning_rate=0.0, schedule_kind=kind)
        profile = np.array(pipe.stash_profile(x, y))
        peaks[kind] = profile.max(axis=0).tolist()
        assert profile[-1].tolist() == [0, 0, 0]
    assert peaks["sequential"] == [1, 1, 1]
    assert peaks["gpipe"] == [8, 8, 8]
    assert peaks["1f1b"] == [4, 2, 0]  # 2(S-1-s) in flight; the last stage needs no stash


def test_a_step_after_an_interrupted_one_starts_clean(devs, batch):
    x, y = batch
    stages = models.cnn_stages(devices=devs[:3])
    pipe = pipeline.Pipeline(stages, devs[:3], micro_batches=4, learning_rate=0.0)
    ref_loss, _ = _reference(stages, x, y)
    pipe.gradients(x, y)
    pipe._stage_inputs(x, y)  # an interrupted step leaves items behind
    pipe._run_tick(*pipe.ticks[0])
    loss, _ = pipe.gradients(x, y)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)


def test_a_get_from_an_empty_buffer_is_refused_not_blocked(devs, batch):
    x, y = batch
    pipe = pipeline.Pipeline(models.cnn_stages(devices=devs[:3]), devs[:3], micro_batches=2, learning_rate=0.0)
    pipe.gradients(x, y)
    with pytest.raises(pipeline.PipelineError, match="'forward0' .* is empty: a get would wait forever"):
        pipe._run_tick(frozenset([1]), frozenset())


def test_a_put_into_a_full_buffer_is_refused(devs):
    buffer = pipeline.Buffer("tiny", devs[0], tf.float32, [2], capacity=1)
    buffer.will_put()
    with pytest.raises(pipeline.PipelineError, match="full"):
        buffer.will_put()


def test_bad_input(devs, batch):
    x, y = batch
    stages = models.cnn_stages(devices=devs[:3])
    with pytest.raises(ValueError, match="one device per stage, got 3 stages and 2 devices"):
        pipeline.Pipeline(stages, devs[:2], micro_batches=2, learning_rate=0.1)
    pipe = pipeline.Pipeline(stages, devs[:3], micro_batches=5, learning_rate=0.1)
    with pytest.raises(ValueError, match="does not split into 5 equal micro-batches"):
        pipe.train_step(x, y)
    with pytest.raises(ValueError, match="micro_batches must be a whole number"):
        pipeline.Pipeline(stages, devs[:3], micro_batches=0, learning_rate=0.1)
    mismatched = [stages[0], models.Sequential([models.Flatten(), models.Dense(10, 10)]), stages[2]]
    with pytest.raises(ValueError, match="stage 1 cannot take the output of stage 0, of shape"):
        pipeline.Pipeline(mismatched, devs[:3], micro_batches=2, learning_rate=0.1).train_step(x, y)
    built = pipeline.Pipeline(stages, devs[:3], micro_batches=2, learning_rate=0.0)
    built.gradients(x, y)
    with pytest.raises(ValueError, match="built for batches of shape"):
        built.gradients(x[:32], y[:32])


def test_a_pipeline_step_can_be_traced(devs, batch):
    x, y = batch
    pipe = pipeline.Pipeline(models.cnn_stages(devices=devs[:3]), devs[:3], micro_batches=4, learning_rate=0.0)
    events = timeline.trace(pipe.train_step, x, y, placement_of=pipe.concrete_functions)
    assert {e.device for e in events} >= set(devs[:3])
    assert {"forward", "backward"} <= {e.phase for e in events}
