import dataclasses

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


def test_fit_compute_and_the_step_model():
    compute = costmodel.fit_compute([64, 128, 256], [0.001 + 64e-6, 0.001 + 128e-6, 0.001 + 256e-6])
    assert compute.per_example == pytest.approx(1e-6) and compute.fixed == pytest.approx(1e-3)
    one = costmodel.step_seconds(compute, 256, 1, 4e6, LINK)
    eight = costmodel.step_seconds(compute, 256, 8, 4e6, LINK, "central")
    assert one == pytest.approx(1e-3 + 256e-6)  # one device: no all-reduce
    assert eight == pytest.approx(one + 14 * (1e-5 + 4e6 * 1e-9))


def test_the_checked_entry_is_the_lesson_with_its_arguments_checked():
    for n, algorithm in [(1, "ring"), (3, "halving_doubling"), (8, "central")]:
        assert costmodel.allreduce_time(1e6, n, LINK, algorithm) == costmodel.allreduce_seconds(1e6, n, LINK, algorithm)
    assert costmodel.allreduce_seconds(1e6, 5, LINK, "halving_doubling") == pytest.approx(
        6 * 1e-5 + 1.6e-3
    )  # 2 ceil(log2 5)


def test_bad_input():
    with pytest.raises(ValueError, match="whole number >= 1"):
        costmodel.allreduce_time(1e6, 0, LINK)
    with pytest.raises(ValueError, match="one of 'ring', 'halving_doubling', 'central'"):
        costmodel.allreduce_time(1e6, 2, LINK, "tree")
    with pytest.raises(ValueError, match="two or more different sizes"):
        costmodel.fit_alpha_beta([1e3, 1e3], [1, 1], 2)
    with pytest.raises(ValueError, match="two or more different sizes"):
        costmodel.fit_compute([64, 64], [1.0, 1.1])
    with pytest.raises(ValueError, match="n >= 2"):
        costmodel.fit_alpha_beta([1e3, 1e4], [1, 2], 1)


@pytest.mark.parametrize("algorithm", costmodel.ALLREDUCE_TERMS)
def test_fit_alpha_beta_recovers_each_algorithm(algorithm):
    sizes = [1e3, 1e5, 1e7]
    times = [costmodel.allreduce_time(s, 4, LINK, algorithm) for s in sizes]
    fitted = costmodel.fit_alpha_beta(sizes, times, 4, algorithm=algorithm)
    assert (fitted.alpha, fitted.beta) == (pytest.approx(LINK.alpha), pytest.approx(LINK.beta))


def test_unknown_algorithms_are_refused_everywhere():
    with pytest.raises(
        ValueError, match=r"algorithm must be one of 'ring', 'halving_doubling', 'central', got 'bogus'"
    ):
        costmodel.fit_alpha_beta([1e3, 1e4], [1e-3, 2e-3], 2, algorithm="bogus")
    with pytest.raises(ValueError, match="got 'bogus'"):
        costmodel.allreduce_time(1e6, 1, LINK, "bogus")  # even where one device would move nothing


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: costmodel.allreduce_time(1e6, 2.0, LINK), r"n \(the number of devices\) must be a whole number >= 1"),
        (lambda: costmodel.allreduce_time(1e6, True, LINK), "whole number >= 1, got True"),
        (lambda: costmodel.fit_alpha_beta([1e3, 1e4], [1, 2], 0), "whole number >= 1, got 0"),
        (lambda: costmodel.fit_alpha_beta([1e3, 1e4, 1e5], [1, 2], 2), "3 sizes but 2 times"),
        (lambda: costmodel.fit_compute([64, 128, 256], [1.0, 1.1]), "3 batch sizes but 2 times"),
    ],
)
def test_bad_counts_name_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_numpy_integers_are_whole_numbers():
    assert costmodel.allreduce_time(1e6, np.int64(4), LINK) == costmodel.allreduce_time(1e6, 4, LINK)


# ---- GPU clusters: each mechanism on and off, on cases small enough to compute by hand ----
# Numbers are chosen to be exact in binary floating point, so the expected values are exact.

INSIDE = costmodel.AlphaBeta(alpha=1.0, beta=1 / 16)  # seconds per message, seconds per byte
ACROSS = costmodel.AlphaBeta(alpha=8.0, beta=1 / 2)
SMALL = costmodel.System(costmodel.Node("4 GPUs", 4, INSIDE), costmodel.Network("slow", ACROSS))


def test_inside_one_node_the_node_link_is_used():
    # ring over 4: 2*3 messages of alpha 1, 2*3/4 * 64 bytes at 1/16 s per byte
    assert costmodel.cluster_allreduce_time(64, 4, SMALL) == 6 + 6
    assert costmodel.cluster_allreduce_time(64, 1, SMALL) == 0


def test_hierarchical_all_reduce_saves_the_network_messages():
    flat = costmodel.cluster_allreduce_time(64, 16, SMALL)
    two_level = costmodel.cluster_allreduce_time(64, 16, SMALL, costmodel.Options(hierarchical=True))
    assert flat == 2 * 15 * 8 + 2 * 15 / 16 * 64 / 2 == 300  # one ring over 16 GPUs, each step crossing the network
    # ring inside the node (12), then a ring over the 4 nodes whose card carries the whole 64 bytes (96)
    assert two_level == (2 * 3 * 1 + 2 * 3 / 4 * 64 / 16) + (2 * 3 * 8 + 2 * 3 / 4 * 64 / 2) == 108


def test_halving_doubling_sends_log2_messages():
    assert costmodel.allreduce_time(64, 8, ACROSS, "halving_doubling") == 2 * 3 * 8 + 2 * 7 / 8 * 64 / 2
    assert costmodel.allreduce_time(64, 8, ACROSS, "ring") == 2 * 7 * 8 + 2 * 7 / 8 * 64 / 2


# 8 tensors of one float32 each (32 bytes), 40 s of compute of which half is the backward pass,
# on 2 GPUs of one node whose link costs 2 + bytes/4 s per all-reduce (ring over 2: 2 messages).
PAIR = costmodel.System(costmodel.Node("2 GPUs", 2, costmodel.AlphaBeta(alpha=1.0, beta=1 / 4)))
TINY = costmodel.Workload("tiny", parameters=8, tensors=8, seconds_per_example=10.0, batch=4, source="made up")
BASE = costmodel.Options(bucket_bytes=16, backward_share=0.5)


def test_buckets_follow_the_fusion_switch():
    assert costmodel.buckets(32, 8, BASE) == [4.0] * 8
    fused = costmodel.Options(fusion=True, bucket_bytes=16)
    assert costmodel.buckets(32, 8, fused) == [16.0, 16.0]
    assert costmodel.buckets(36, 9, fused) == [16.0, 16.0, 4.0]  # the last bucket holds what is left
    assert costmodel.buckets(320, 8, fused) == [40.0] * 8  # a tensor larger than a bucket goes alone


def test_fusion_pays_the_latency_per_bucket_instead_of_per_tensor():
    alone = costmodel.step_time(TINY, 2, PAIR, BASE)
    fused = costmodel.step_time(TINY, 2, PAIR, dataclasses.replace(BASE, fusion=True))
    assert (alone.buckets, alone.communication) == (8, 8 * (2 + 4 / 4))
    assert (fused.buckets, fused.communication) == (2, 2 * (2 + 16 / 4))
    assert alone.communication - fused.communication == (8 - 2) * 2  # six fewer all-reduces of 2 messages
    assert alone.exposed == alone.communication and fused.exposed == fused.communication  # no overlap


def test_overlap_leaves_only_the_last_bucket_exposed_when_the_backward_pass_is_long():
    options = dataclasses.replace(BASE, fusion=True)
    serial = costmodel.step_time(TINY, 2, PAIR, options)
    hidden = costmodel.step_time(TINY, 2, PAIR, dataclasses.replace(options, overlap=True))
    # buckets ready at 10 s and 20 s of the 20 s backward pass, 6 s each: the first ends at 16,
    # the last starts at 20 and ends at 26, so 6 s are exposed instead of 12
    assert (serial.exposed, hidden.exposed) == (12, 6)
    assert (serial.seconds, hidden.seconds) == (52, 46)
    assert costmodel.cluster_efficiency(TINY, 2, PAIR, dataclasses.replace(options, overlap=True)) == 40 / 46


def test_overlap_cannot_hide_more_than_the_backward_pass():
    # bucket times 6 and 6 against a backward pass of 2 s: they run back to back from 1 s
    assert costmodel.exposed_communication([6, 6], [16, 16], 2.0, overlap=True) == 1 + 6 + 6 - 2
    assert costmodel.exposed_communication([6, 6], [16, 16], 2.0, overlap=False) == 12


def test_16_bit_gradients_halve_the_bandwidth_term_only():
    one = dataclasses.replace(BASE, fusion=True, bucket_bytes=1024)  # one bucket
    full = costmodel.step_time(TINY, 2, PAIR, one)
    half = costmodel.step_time(TINY, 2, PAIR, dataclasses.replace(one, gradient_bits=16))
    assert (full.communication, half.communication) == (2 + 32 / 4, 2 + 16 / 4)


def test_with_links_scales_latency_and_bandwidth():
    slow = costmodel.with_links(SMALL, latency=4, bandwidth=0.5)
    assert slow.node.link == costmodel.AlphaBeta(4.0, 1 / 8) and slow.network.link == costmodel.AlphaBeta(32.0, 1.0)
    assert costmodel.with_links(PAIR, latency=2).network is None
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        costmodel.with_links(SMALL, bandwidth=0)


def test_switching_terms_off():
    options = costmodel.Options(overlap=True, fusion=True, hierarchical=True, gradient_bits=16)
    assert costmodel.terms_on(options) == list(costmodel.TERMS)
    assert costmodel.switched_off(options, "gradient_bits").gradient_bits == 32
    assert costmodel.switched_off(options, "overlap").overlap is False
    assert costmodel.terms_on(costmodel.Options()) == []


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: costmodel.Options(algorithm="tree"), "algorithm must be one of 'ring', 'halving_doubling'"),
        (lambda: costmodel.Options(gradient_bits=8), "gradient_bits must be 16 or 32, got 8"),
        (lambda: costmodel.Options(bucket_bytes=0), "bucket_bytes must be > 0"),
        (lambda: costmodel.Options(bucket_bytes=-1), "bucket_bytes must be a finite number >= 0, got -1"),
        (lambda: costmodel.Options(backward_share=1.5), r"backward_share must be in \(0, 1\]"),
        (lambda: costmodel.cluster_allreduce_time(64, 0, SMALL), r"n \(the number of GPUs\) must be a whole number"),
        (lambda: costmodel.cluster_allreduce_time(-64, 4, SMALL), "num_bytes must be a finite number >= 0, got -64"),
        (lambda: costmodel.cluster_allreduce_time(64, 6, SMALL), "n = 6 GPUs do not fill nodes of 4"),
        (lambda: costmodel.cluster_allreduce_time(64, 4, PAIR), "one node of 2 GPUs; give the System a Network"),
        (lambda: costmodel.allreduce_time(-1.0, 2, LINK), "num_bytes must be a finite number >= 0"),
        (lambda: costmodel.allreduce_time("big", 2, LINK), "num_bytes must be a number >= 0, got 'big'"),
        (lambda: costmodel.buckets(-32, 8), "gradient_bytes must be a finite number >= 0"),
        (lambda: costmodel.buckets(32, 0), "tensors must be a whole number >= 1"),
        (lambda: costmodel.AlphaBeta(alpha=-1e-6, beta=1e-9), r"alpha \(seconds per message\) must be"),
        (lambda: costmodel.Node("none", 0, LINK), r"Node.gpus \(GPUs per node\) must be a whole number >= 1"),
        (lambda: costmodel.Workload("m", 10, 2, -1.0, 4, "s"), "seconds_per_example must be a finite number >= 0"),
        (lambda: costmodel.Workload("m", -10, 2, 1.0, 4, "s"), "parameters must be a whole number >= 1"),
        (lambda: costmodel.switched_off(costmodel.Options(), "tensor cores"), "term must be one of 'overlap'"),
    ],
)
def test_bad_cluster_inputs_are_refused_with_the_fix(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_zero_terms_follow_the_papers_formulas():
    psi = 1e9
    assert [costmodel.zero_memory(psi, 64, s) for s in range(4)] == pytest.approx(
        [16 * psi, 4 * psi + 12 * psi / 64, 2 * psi + 14 * psi / 64, 16 * psi / 64]
    )
    assert costmodel.zero_traffic(psi, 4, 1) == costmodel.zero_traffic(psi, 4, 0) == 2 * 0.75 * psi * 2
    assert costmodel.zero_traffic(psi, 4, 3) == 1.5 * costmodel.zero_traffic(psi, 4, 2)
    assert costmodel.tensor_parallel_traffic(1e6, 8, 2) == pytest.approx(2 * 4 * 2 * 7 / 8 * 2e6)
    rows = costmodel.sharding_table(psi, 8, LINK, 1e6, 24)
    assert [r["method"] for r in rows] == list(costmodel.SHARDINGS)
    assert rows[1]["seconds"] == pytest.approx(rows[1]["bytes_sent"] * LINK.beta)
    with pytest.raises(ValueError, match="stage must be 0"):
        costmodel.zero_memory(psi, 8, 4)
    with pytest.raises(ValueError, match="whole number >= 1"):
        costmodel.zero_traffic(psi, 0, 1)
