import pytest
import tensorflow as tf

from tutorial_lib import strategy


def run_a_step(mirrored):
    """Each replica's rank summed across the replicas by a collective all-reduce, as a training step's
    gradients are: the step joins the collective group that the strategy's keys name."""

    @tf.function
    def step():
        def replica_step():
            context = tf.distribute.get_replica_context()
            return context.all_reduce("SUM", tf.cast(context.replica_id_in_sync_group, tf.float32) + 1)

        return mirrored.experimental_local_results(mirrored.run(replica_step))

    return [float(total) for total in step()]


def test_strategies_of_several_sizes_share_a_process_and_leave_a_plain_one_working(devs, monkeypatch):
    # A base of this test's own, so that a plain strategy that another test of this process built
    # (at the default base 0) cannot meet ours: the helper must hand it back untouched.
    monkeypatch.setattr(tf.distribute.MirroredStrategy, "_collective_key_base", 5_000)
    for n in (4, 3, 2):
        assert run_a_step(strategy.mirrored_strategy(devs[:n])) == [n * (n + 1) / 2] * n
    assert tf.distribute.MirroredStrategy._collective_key_base == 5_000
    # Before the helper restored the base, this one took the 2-device strategy's keys and failed
    # with "Device CPU:2 is joining a group with size3, but that group has size 2".
    assert run_a_step(tf.distribute.MirroredStrategy(devs[:3])) == [6.0] * 3
    assert tf.distribute.MirroredStrategy._collective_key_base == 5_000


def test_the_base_is_restored_when_the_strategy_cannot_be_built(devs):
    before = tf.distribute.MirroredStrategy._collective_key_base
    with pytest.raises(AssertionError, match="No duplicates"):
        strategy.mirrored_strategy([devs[0], devs[0]])
    assert tf.distribute.MirroredStrategy._collective_key_base == before
