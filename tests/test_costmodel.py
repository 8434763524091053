import numpy as np
import pytest

from tutorial_lib import costmodel

LINK = costmodel.AlphaBeta(alpha=1e-5, beta=1e-9)


def test_allreduce_time_follows_the_alpha_beta_formulas():
    assert costmodel.allreduce_time(1e6, 1, LINK) == 0
    assert costmodel.allreduce_time(1e6, 4, LINK) == pytest.approx(6 * 1e-5 + 1.5 * 1e6 * 1e-9)
    assert costmodel.allreduce_time(1e6, 4, LINK, "central") == pytest.approx(6 * (1e-5 + 1e6 * 1e-9))
    # the ring's bandwidth term levels off at 2 S beta, the central one grows with N
    assert costmodel.allreduce_time(1e9, 512, LINK) < 2.1 * 1e9 * 1e-9 + 1022 * 1e-5


def test_fit_alpha_beta_recovers_the_parameters():
    sizes = np.array([1e3, 1e4, 1e5, 1e6, 1e7])
    times = [costmodel.allreduce_time(s, 4, LINK) for s in sizes]
    fitted = costmodel.fit_alpha_beta(sizes, times, 4)
    assert fitted.alpha == pytest.approx(LINK.alpha, rel=1e-6)
    assert fitted.beta == pytest.approx(LINK.beta, rel=1e-6)


def test_fit_compute_and_predictions():
    compute = costmodel.fit_compute([64, 128, 256], [0.001 + 64e-6, 0.001 + 128e-6, 0.001 + 256e-6])
    assert compute.per_example == pytest.approx(1e-6) and compute.fixed == pytest.approx(1e-3)
    one = costmodel.predict_step(compute, 256, 1, 4e6, LINK)
    eight = costmodel.predict_step(compute, 256, 8, 4e6, LINK)
    assert eight > one
    assert costmodel.weak_scaling_efficiency(compute, 256, 8, 4e6, LINK) == pytest.approx(one / eight)
    assert costmodel.weak_scaling_efficiency(compute, 256, 1, 4e6, LINK) == 1


def test_pipeline_prediction_has_the_bubble_of_gpipe():
    t = costmodel.predict_pipeline(1.0, stages=2, micro_batches=8)
    assert t == pytest.approx(9.0)  # (M + S - 1) stage times
    assert costmodel.predict_pipeline(1.0, 2, 8, tick_overhead=0.1) == pytest.approx(9.0 + 18 * 0.1)


def test_hardware_presets_state_their_assumptions():
    for hw in (costmodel.GPU_NODE, costmodel.GPU_CLUSTER):
        assert hw.flops > 0 and hw.link.beta > 0 and "GB/s" in hw.name
        assert hw.compute(2e9).per_example == pytest.approx(2e9 / hw.flops)


def test_bad_input():
    with pytest.raises(ValueError, match="whole number >= 1"):
        costmodel.allreduce_time(1e6, 0, LINK)
    with pytest.raises(ValueError, match="'ring' or 'central'"):
        costmodel.allreduce_time(1e6, 2, LINK, "tree")
    with pytest.raises(ValueError, match="two or more different sizes"):
        costmodel.fit_alpha_beta([1e3, 1e3], [1, 1], 2)
    with pytest.raises(ValueError, match="two or more different sizes"):
        costmodel.fit_compute([64, 64], [1.0, 1.1])
    with pytest.raises(ValueError, match="n >= 2"):
        costmodel.fit_alpha_beta([1e3, 1e4], [1, 2], 1)


@pytest.mark.parametrize("algorithm", costmodel.ALGORITHMS)
def test_fit_alpha_beta_recovers_each_algorithm(algorithm):
    sizes = [1e3, 1e5, 1e7]
    times = [costmodel.allreduce_time(s, 4, LINK, algorithm) for s in sizes]
    fitted = costmodel.fit_alpha_beta(sizes, times, 4, algorithm=algorithm)
    assert (fitted.alpha, fitted.beta) == (pytest.approx(LINK.alpha), pytest.approx(LINK.beta))


def test_unknown_algorithms_are_refused_everywhere():
    with pytest.raises(ValueError, match=r"algorithm must be 'ring' or 'central', got 'bogus'"):
        costmodel.fit_alpha_beta([1e3, 1e4], [1e-3, 2e-3], 2, algorithm="bogus")
    with pytest.raises(ValueError, match="got 'bogus'"):
        costmodel.allreduce_time(1e6, 1, LINK, "bogus")  # even where one device would move nothing
    with pytest.raises(ValueError, match="got 'bogus'"):
        costmodel.predict_step(costmodel.Compute(1e-6, 0.0), 64, 2, 1e6, LINK, algorithm="bogus")


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: costmodel.allreduce_time(1e6, 2.0, LINK), r"n \(the number of devices\) must be a whole number >= 1"),
        (lambda: costmodel.allreduce_time(1e6, True, LINK), "whole number >= 1, got True"),
        (lambda: costmodel.fit_alpha_beta([1e3, 1e4], [1, 2], 0), "whole number >= 1, got 0"),
        (lambda: costmodel.predict_pipeline(1.0, stages=0, micro_batches=4), "stages must be a whole number >= 1"),
        (lambda: costmodel.predict_pipeline(1.0, stages=2, micro_batches=1.5), "micro_batches must be a whole number"),
        (lambda: costmodel.fit_alpha_beta([1e3, 1e4, 1e5], [1, 2], 2), "3 sizes but 2 times"),
        (lambda: costmodel.fit_compute([64, 128, 256], [1.0, 1.1]), "3 batch sizes but 2 times"),
    ],
)
def test_bad_counts_name_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_numpy_integers_are_whole_numbers():
    assert costmodel.allreduce_time(1e6, np.int64(4), LINK) == costmodel.allreduce_time(1e6, 4, LINK)
