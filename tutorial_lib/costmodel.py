"""A cost model of data-parallel and pipelined training, held against published results.

- All-reduce, the alpha-beta model: a message costs alpha (latency) plus bytes x beta
  (seconds per byte). A ring all-reduce of S bytes over N devices sends 2(N-1) messages of
  S/N bytes one after another: t = 2(N-1) alpha + 2(N-1)/N S beta. Recursive halving and
  doubling moves the same bytes in 2 log2(N) steps. A central one sends N-1 tensors in and
  N-1 out through one link: t = 2(N-1) (alpha + S beta).
- A data-parallel step on one machine: compute (seconds per example x per-device batch,
  plus a fixed cost), then the all-reduce of the gradients, not overlapped
  (`predict_step`, fitted to this machine's measurements in notebook 06).
- A data-parallel step on a GPU cluster (`step_time`): GPUs grouped in nodes (`Node`: GPUs
  per node, the link between them) joined by a network (`Network`: the link through one
  node's network card), with four mechanisms that published systems rely on, each one a
  switch of `Options`:
    * overlap: the gradients are all-reduced in buckets while the backward pass still runs
      (Horovod, PyTorch DDP); only what the backward pass cannot hide is exposed, at least
      the last bucket, which is ready only when the backward pass ends;
    * fusion: small gradient tensors are packed into buckets of `bucket_bytes` (Horovod's
      tensor fusion, DDP's buckets), so the per-message latency is paid per bucket instead
      of per tensor;
    * hierarchical: a two-level all-reduce: reduce-scatter inside each node over the fast
      link, an all-reduce across nodes where each of the node's g GPUs carries 1/g of the
      data (the g transfers share the node's network card), all-gather inside the node;
    * gradient_bits=16: 16-bit gradients, half the bytes.
- A pipeline: (M+S-1)/M times the work of one stage, plus a fixed cost per tick.

`python -m tutorial_lib.costmodel --published [--json PATH]` prints published scaling
results beside this model's predictions (`PUBLISHED`, `published_table`). Every model and
hardware figure there names its public source; none is fitted to the published efficiencies.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import checks


def _nonnegative(value, name: str) -> float:
    """`value` as a float if it is a finite number >= 0, else a ValueError that names it."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise ValueError(f"{name} must be a number >= 0, got {value!r}.")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}.")
    return float(value)


@dataclass(frozen=True)
class AlphaBeta:
    alpha: float  # seconds per message
    beta: float  # seconds per byte

    def __post_init__(self):
        _nonnegative(self.alpha, "alpha (seconds per message)")
        _nonnegative(self.beta, "beta (seconds per byte)")


@dataclass(frozen=True)
class Compute:
    per_example: float  # seconds per example on one device
    fixed: float  # seconds per step whatever the batch


@dataclass(frozen=True)
class Hardware:
    """One GPU's speed and the one link its all-reduce crosses (see `System` for clusters)."""

    name: str
    flops: float  # sustained floating-point operations per second per device
    link: AlphaBeta  # the slowest link an all-reduce crosses

    def compute(self, flops_per_example: float, fixed: float = 0.0) -> Compute:
        return Compute(flops_per_example / self.flops, fixed)


# Link figures used below, one per kind of link and the same in every system. Bandwidths are
# public line rates (PCIe 3.0 x16: 15.75 GB/s, of which a copy sustains about 12 GB/s; NVLink 1
# on the P100: 20 GB/s per link and direction, NVIDIA's Tesla P100 whitepaper; Ethernet and
# RoCE: Gbit/s / 8). Latencies per message are orders of magnitude, not measurements: 5 us
# over NVLink and over an RDMA network (RoCE, InfiniBand), 10 us over PCIe through the host,
# 25 us over TCP through the kernel. Notebook 06 shows how much the predictions depend on them.
PCIE3 = AlphaBeta(alpha=10e-6, beta=1 / 12e9)
NVLINK_P100 = AlphaBeta(alpha=5e-6, beta=1 / 20e9)
NVLINK_A100 = AlphaBeta(alpha=5e-6, beta=1 / 150e9)  # 300 GB/s per direction, half sustained


def network_link(gbit_per_s: float, rdma: bool) -> AlphaBeta:
    """A node's network card at its line rate, with the latency of RDMA or of TCP."""
    return AlphaBeta(alpha=5e-6 if rdma else 25e-6, beta=8 / (gbit_per_s * 1e9))


# A GPU of one machine: kept for the single-link examples; clusters are `System`s below.
GPU_NODE = Hardware("one A100-class GPU, all-reduce over NVLink inside one node (150 GB/s, 5 us)", 100e12, NVLINK_A100)
GPU_CLUSTER = Hardware(
    "one A100-class GPU, all-reduce over 100 Gbit/s InfiniBand between nodes (12.5 GB/s, 5 us)",
    100e12,
    network_link(100, rdma=True),
)


# Each all-reduce over n devices as (messages sent one after another, bytes through the
# busiest link per byte of the tensor): t = messages x alpha + per_byte x S x beta.
_ALGORITHMS = {
    "ring": lambda n: (2 * (n - 1), 2 * (n - 1) / n),
    "halving_doubling": lambda n: (2 * math.ceil(math.log2(n)), 2 * (n - 1) / n),
    "central": lambda n: (2 * (n - 1), 2 * (n - 1)),
}
ALGORITHMS = tuple(_ALGORITHMS)


def _coefficients(n: int, algorithm: str) -> tuple[float, float]:
    """(messages, per_byte) of `algorithm` over `n` devices, or a clear error."""
    if algorithm not in _ALGORITHMS:
        raise ValueError(f"algorithm must be one of {', '.join(map(repr, ALGORITHMS))}, got {algorithm!r}.")
    return _ALGORITHMS[algorithm](checks.whole_number(n, "n (the number of devices)"))


def allreduce_time(num_bytes: float, n: int, link: AlphaBeta, algorithm: str = "ring") -> float:
    """Predicted seconds of one all-reduce of `num_bytes` over `n` devices (0 on one device)."""
    messages, per_byte = _coefficients(n, algorithm)
    return messages * link.alpha + per_byte * _nonnegative(num_bytes, "num_bytes") * link.beta


def fit_alpha_beta(num_bytes, seconds, n: int, algorithm: str = "ring") -> AlphaBeta:
    """Least-squares alpha and beta from all-reduce times measured at several sizes."""
    messages, per_byte = _coefficients(n, algorithm)
    if n < 2:
        raise ValueError("an all-reduce over one device moves nothing; measure with n >= 2.")
    checks.same_length("sizes", num_bytes, "times", seconds)
    num_bytes, seconds = np.asarray(num_bytes, float), np.asarray(seconds, float)
    if len(np.unique(num_bytes)) < 2:
        raise ValueError("fitting alpha and beta needs times at two or more different sizes.")
    design = np.stack([np.full_like(num_bytes, messages), per_byte * num_bytes], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(design, seconds, rcond=None)
    return AlphaBeta(max(float(alpha), 0.0), max(float(beta), 0.0))


def fit_compute(batch_sizes, seconds) -> Compute:
    """Seconds per example and fixed seconds per step, from one-device step times."""
    checks.same_length("batch sizes", batch_sizes, "times", seconds)
    if len(set(batch_sizes)) < 2:
        raise ValueError("fitting compute needs one time per batch size, at two or more different sizes.")
    slope, intercept = np.polyfit(np.asarray(batch_sizes, float), np.asarray(seconds, float), 1)
    return Compute(max(float(slope), 0.0), max(float(intercept), 0.0))


def predict_step(
    compute: Compute, per_device_batch: int, n: int, gradient_bytes: float, link: AlphaBeta, algorithm: str = "ring"
) -> float:
    """Seconds of one data-parallel step: compute, then the gradient all-reduce."""
    return compute.fixed + compute.per_example * per_device_batch + allreduce_time(gradient_bytes, n, link, algorithm)


def weak_scaling_efficiency(
    compute: Compute, per_device_batch: int, n: int, gradient_bytes: float, link: AlphaBeta, algorithm: str = "ring"
) -> float:
    """Throughput on n devices over n times the throughput on one (1.0 = perfect)."""
    one = predict_step(compute, per_device_batch, 1, gradient_bytes, link, algorithm)
    return one / predict_step(compute, per_device_batch, n, gradient_bytes, link, algorithm)


def predict_pipeline(stage_seconds: float, stages: int, micro_batches: int, tick_overhead: float = 0.0) -> float:
    """Seconds of a GPipe step: M+S-1 forward ticks and as many backward ticks, each stage
    taking `stage_seconds` per micro-batch (forward and backward together)."""
    checks.whole_number(stages, "stages")
    checks.whole_number(micro_batches, "micro_batches")
    ticks = micro_batches + stages - 1
    return ticks * stage_seconds + 2 * ticks * tick_overhead


# ---------------------------------------------------------------------------------------
# GPU clusters: nodes, a network, and the mechanisms that hide or shrink the all-reduce.


@dataclass(frozen=True)
class Node:
    """One machine: how many GPUs it holds and the link an all-reduce among them crosses."""

    name: str
    gpus: int
    link: AlphaBeta

    def __post_init__(self):
        checks.whole_number(self.gpus, "Node.gpus (GPUs per node)")


@dataclass(frozen=True)
class Network:
    """What joins the nodes: `link` is the path through one node's network card."""

    name: str
    link: AlphaBeta


@dataclass(frozen=True)
class System:
    """Nodes of `node`, joined by `network` (None: the system is one node)."""

    node: Node
    network: Network | None = None

    @property
    def name(self) -> str:
        where = f"nodes joined by {self.network.name}" if self.network else "one node"
        return f"{self.node.name}; {where}"


def with_links(system: System, latency: float = 1.0, bandwidth: float = 1.0) -> System:
    """`system` with every link's latency multiplied by `latency` and its bandwidth by `bandwidth`:
    how much a prediction depends on the stated link figures."""
    latency = _nonnegative(latency, "latency")
    if _nonnegative(bandwidth, "bandwidth") == 0:
        raise ValueError("bandwidth must be > 0: it divides the seconds per byte.")

    def scaled(link: AlphaBeta) -> AlphaBeta:
        return AlphaBeta(link.alpha * latency, link.beta / bandwidth)

    node = dataclasses.replace(system.node, link=scaled(system.node.link))
    network = system.network and dataclasses.replace(system.network, link=scaled(system.network.link))
    return System(node, network)


@dataclass(frozen=True)
class Options:
    """The mechanisms a framework uses; `TERMS` are the ones the reader switches off one by one."""

    algorithm: str = "ring"  # across nodes, or flat over all GPUs (see `cluster_allreduce_time`)
    overlap: bool = False  # all-reduce buckets while the backward pass runs
    fusion: bool = False  # pack small tensors into buckets of `bucket_bytes`
    hierarchical: bool = False  # reduce-scatter in the node, all-reduce across, all-gather in the node
    gradient_bits: int = 32  # 16: half the bytes
    # Horovod's fusion threshold (HOROVOD_FUSION_THRESHOLD: 64 MB until v0.21, 128 MB since); DDP's is 25 MB
    bucket_bytes: float = 64 * 2**20
    # backward = 2 x forward in FLOPs (Kaplan et al. 2020, arXiv:2001.08361: 2N per token forward, 4N backward)
    backward_share: float = 2 / 3

    def __post_init__(self):
        _coefficients(1, self.algorithm)
        if self.gradient_bits not in (16, 32):
            raise ValueError(f"gradient_bits must be 16 or 32, got {self.gradient_bits!r}.")
        if _nonnegative(self.bucket_bytes, "bucket_bytes") == 0:
            raise ValueError("bucket_bytes must be > 0: a bucket has to hold at least one tensor.")
        if not 0 < _nonnegative(self.backward_share, "backward_share") <= 1:
            raise ValueError(f"backward_share must be in (0, 1], got {self.backward_share!r}.")


TERMS = ("overlap", "fusion", "hierarchical", "gradient_bits")


def switched_off(options: Options, term: str) -> Options:
    """`options` with one mechanism of `TERMS` switched off (16-bit gradients back to 32)."""
    if term not in TERMS:
        raise ValueError(f"term must be one of {', '.join(map(repr, TERMS))}, got {term!r}.")
    return dataclasses.replace(options, **{term: 32 if term == "gradient_bits" else False})


def terms_on(options: Options) -> list[str]:
    return [t for t in TERMS if switched_off(options, t) != options]


@dataclass(frozen=True)
class Workload:
    """A model trained at a per-GPU batch: its size, its speed on one GPU, and their sources."""

    model: str
    parameters: int
    tensors: int  # trainable tensors, each all-reduced on its own without fusion
    seconds_per_example: float  # on one GPU, forward and backward
    batch: int  # examples per GPU per step
    source: str

    def __post_init__(self):
        checks.whole_number(self.parameters, "parameters")
        checks.whole_number(self.tensors, "tensors")
        checks.whole_number(self.batch, "batch (examples per GPU)")
        _nonnegative(self.seconds_per_example, "seconds_per_example")

    @property
    def compute_seconds(self) -> float:
        return self.seconds_per_example * self.batch


def cluster_allreduce_time(num_bytes: float, n: int, system: System, options: Options = Options()) -> float:
    """Seconds of one all-reduce of `num_bytes` over `n` GPUs of `system`.

    Inside one node: `options.algorithm` over the node's link. Across nodes, flat: the same
    algorithm over all n GPUs, each step as slow as the network card it crosses.
    Hierarchical: a ring inside each node (its reduce-scatter and all-gather cost one ring
    all-reduce), plus `options.algorithm` across the nodes, where each of the g GPUs of a
    node carries 1/g of the data; the g transfers share the node's card, so the bytes
    through it are those of one all-reduce of `num_bytes`, and the saving is in messages:
    2(n/g - 1) in a ring instead of 2(n - 1).
    """
    n, gpus = checks.whole_number(n, "n (the number of GPUs)"), system.node.gpus
    num_bytes = _nonnegative(num_bytes, "num_bytes")
    if n <= gpus:
        return allreduce_time(num_bytes, n, system.node.link, options.algorithm)
    if system.network is None:
        raise ValueError(f"{system.node.name} is one node of {gpus} GPUs; give the System a Network for n = {n}.")
    if n % gpus:
        raise ValueError(f"n = {n} GPUs do not fill nodes of {gpus}: pass a multiple of {gpus}.")
    if not options.hierarchical:
        return allreduce_time(num_bytes, n, system.network.link, options.algorithm)
    inside = allreduce_time(num_bytes, gpus, system.node.link, "ring")
    return inside + allreduce_time(num_bytes, n // gpus, system.network.link, options.algorithm)


def buckets(gradient_bytes: float, tensors: int, options: Options = Options()) -> list[float]:
    """Bytes of each all-reduce of a step, in the order the backward pass makes them ready.

    The tensors are taken to be of equal size (a stated simplification). Without fusion
    each is all-reduced alone; with fusion, consecutive tensors share a bucket of at most
    `options.bucket_bytes` (a tensor larger than a bucket goes alone), the last bucket
    holding what is left.
    """
    tensors = checks.whole_number(tensors, "tensors")
    size = _nonnegative(gradient_bytes, "gradient_bytes") / tensors
    per_bucket = 1
    if options.fusion:
        per_bucket = tensors if size == 0 else min(tensors, max(1, int(options.bucket_bytes // size)))
    full, rest = divmod(tensors, per_bucket)
    return [per_bucket * size] * full + [rest * size] * (rest > 0)


def exposed_communication(bucket_seconds, bucket_bytes, backward_seconds: float, overlap: bool) -> float:
    """Seconds of all-reduce the step waits for after its backward pass.

    Without overlap, all of it. With overlap, the gradients are produced at an even rate
    over the backward pass (a stated simplification), each bucket starts when its last
    byte is ready and the previous bucket is done, and what runs past the end of the
    backward pass is exposed: at least the last bucket, ready only when the pass ends.
    """
    checks.same_length("bucket times", bucket_seconds, "bucket sizes", bucket_bytes)
    if not overlap:
        return float(sum(bucket_seconds))
    total, ready_bytes, done = float(sum(bucket_bytes)), 0.0, 0.0
    for seconds, size in zip(bucket_seconds, bucket_bytes, strict=True):
        ready_bytes += size
        ready = backward_seconds * ready_bytes / total if total else backward_seconds
        done = max(done, ready) + seconds
    return max(done - backward_seconds, 0.0)


@dataclass(frozen=True)
class Step:
    compute: float  # seconds of forward and backward on one GPU
    communication: float  # seconds of all-reduce, all buckets
    exposed: float  # the part of it the step waits for
    buckets: int

    @property
    def seconds(self) -> float:
        return self.compute + self.exposed


def step_time(workload: Workload, n: int, system: System, options: Options = Options()) -> Step:
    """One data-parallel step of `workload` on `n` GPUs of `system`, taken apart."""
    sizes = buckets(workload.parameters * options.gradient_bits / 8, workload.tensors, options)
    seconds = [cluster_allreduce_time(b, n, system, options) for b in sizes]
    backward = options.backward_share * workload.compute_seconds
    exposed = exposed_communication(seconds, sizes, backward, options.overlap)
    return Step(workload.compute_seconds, float(sum(seconds)), exposed, len(sizes))


def cluster_efficiency(
    workload: Workload, n: int, system: System, options: Options = Options(), baseline: int = 1
) -> float:
    """Weak scaling: throughput per GPU on `n` GPUs over that on `baseline` GPUs (1.0 = perfect)."""
    return step_time(workload, baseline, system, options).seconds / step_time(workload, n, system, options).seconds


# ---------------------------------------------------------------------------------------
# Published scaling results, and the model's predictions for the same runs.

# Trainable parameters and tensors, counted on keras.applications.<Model>(weights=None)
# (TensorFlow 2.21 / Keras 3); tf_cnn_benchmarks' versions differ by a few biases.
# Forward multiply-adds per 224x224 image: He et al. 2016 (arXiv:1512.03385), Table 1.
MODEL_FIGURES = {
    "Inception V3": {"parameters": 23_817_352, "tensors": 190},
    "ResNet-50": {"parameters": 25_583_592, "tensors": 214, "multiply_adds": 3.8e9},
    "ResNet-101": {"parameters": 44_601_832, "tensors": 418, "multiply_adds": 7.6e9},
    "ResNet-152": {"parameters": 60_268_520, "tensors": 622, "multiply_adds": 11.3e9},
    "VGG-16": {"parameters": 138_357_544, "tensors": 32},
}

# Images per second on ONE Tesla P100, synthetic ImageNet, tf_cnn_benchmarks, May 2017:
# TensorFlow's benchmarks page (tensorflow/docs, site/en/r1/guide/performance/benchmarks.md,
# "Details for NVIDIA DGX-1"), keyed by (model, batch per GPU).
P100_IMAGES_PER_S = {
    ("Inception V3", 64): 142.0,
    ("ResNet-50", 64): 219.0,
    ("ResNet-152", 64): 91.8,
    ("VGG-16", 64): 154.0,
    ("ResNet-50", 32): 195.0,
}
_SPEED_SOURCE = "one P100's images/s from TensorFlow's benchmarks page (DGX-1, synthetic data, May 2017)"


def p100_seconds_per_example(model: str, batch: int) -> tuple[float, str]:
    """Seconds per image on one P100 and where the figure comes from.

    The page has no ResNet-101: its time is interpolated linearly in multiply-adds between
    the page's ResNet-50 and ResNet-152 at the same batch (He et al.'s counts).
    """
    if (model, batch) in P100_IMAGES_PER_S:
        return 1 / P100_IMAGES_PER_S[model, batch], f"{_SPEED_SOURCE}, batch {batch}"
    if model == "ResNet-101" and batch == 64:
        (f50, f101, f152) = (MODEL_FIGURES[m]["multiply_adds"] for m in ("ResNet-50", "ResNet-101", "ResNet-152"))
        t50, t152 = 1 / P100_IMAGES_PER_S["ResNet-50", 64], 1 / P100_IMAGES_PER_S["ResNet-152", 64]
        seconds = t50 + (f101 - f50) / (f152 - f50) * (t152 - t50)
        return seconds, f"{_SPEED_SOURCE}, interpolated in multiply-adds between ResNet-50 and ResNet-152, batch 64"
    raise ValueError(f"no published P100 speed for {model!r} at batch {batch}; known: {sorted(P100_IMAGES_PER_S)}.")


def p100_workload(model: str, batch: int) -> Workload:
    seconds, speed_source = p100_seconds_per_example(model, batch)
    figures = MODEL_FIGURES[model]
    source = f"parameters and tensors of keras.applications; {speed_source}"
    return Workload(model, figures["parameters"], figures["tensors"], seconds, batch, source)


# Images per second on ONE A100 40GB, ResNet-50 v1.5 (same parameters as ResNet-50), batch 256,
# real data averaged over an epoch: NVIDIA DeepLearningExamples,
# TensorFlow/Classification/ConvNets/resnet50v1.5/README.md, "Training performance: NVIDIA DGX A100".
A100_IMAGES_PER_S = {"TF32": 909.0, "AMP": 2375.0}  # AMP: automatic mixed precision


def a100_resnet50(precision: str) -> Workload:
    if precision not in A100_IMAGES_PER_S:
        raise ValueError(f"precision must be one of {sorted(A100_IMAGES_PER_S)}, got {precision!r}.")
    figures = MODEL_FIGURES["ResNet-50"]
    source = (
        "parameters and tensors of keras.applications; one A100's images/s from NVIDIA DeepLearningExamples "
        f"(ResNet-50 v1.5, TensorFlow, {precision} + XLA, batch 256, real data)"
    )
    seconds = 1 / A100_IMAGES_PER_S[precision]
    return Workload(f"ResNet-50 {precision}", figures["parameters"], figures["tensors"], seconds, 256, source)


@dataclass(frozen=True)
class Published:
    """One published scaling result and everything the model needs to predict it."""

    label: str
    workload: Workload
    gpus: int
    baseline_gpus: int  # the efficiency is per-GPU throughput relative to this many GPUs
    efficiency: float  # as published, a fraction
    system: System
    options: Options  # what the published system did, one set per system
    source: str


# One set of assumptions per published system, stated here and nowhere tuned per row.
HOROVOD_CLUSTER = System(
    Node("server of 4 Pascal GPUs (taken as P100) on PCIe 3.0 x16 (12 GB/s, 10 us)", 4, PCIE3),
    Network("25 Gbit/s RoCE (3.125 GB/s, 5 us)", network_link(25, rdma=True)),
)
# Horovod 0.9-0.11 (2017): one NCCL 2 ring over all GPUs, each gradient queued as soon as the
# backward pass makes it, tensor fusion up to 64 MB (its docs, tensor-fusion.rst); its
# hierarchical all-reduce came in 2018. Horovod fuses what is ready in each cycle (5 ms then)
# up to the threshold; buckets of the threshold's size are the model's coarser stand-in.
HOROVOD_OPTIONS = Options(algorithm="ring", overlap=True, fusion=True)
DGX1_HOST = System(
    Node("DGX-1, 8 P100, gradients to a parameter server on the host CPU over PCIe 3.0 x16 (12 GB/s, 10 us)", 8, PCIE3)
)
# variable_update=parameter_server, local_parameter_device=cpu: each gradient goes to the host as
# soon as it exists (TensorFlow's dataflow), one transfer per tensor; "central" over one
# PCIe link is a pessimistic stand-in for the host's several links.
DGX1_OPTIONS = Options(algorithm="central", overlap=True)
BIG_BASIN = System(
    Node("Big Basin server, 8 P100 on NVLink (20 GB/s, 5 us)", 8, NVLINK_P100),
    Network("50 Gbit/s Ethernet, TCP (6.25 GB/s, 25 us)", network_link(50, rdma=False)),
)
DGX_A100 = System(Node("DGX A100, 8 A100 on NVLink and NVSwitch (150 GB/s, 5 us)", 8, NVLINK_A100))
# For extrapolating: such nodes joined by one 100 Gbit/s InfiniBand card each (many have more).
A100_CLUSTER = System(
    DGX_A100.node, Network("100 Gbit/s InfiniBand, one card per node (12.5 GB/s, 5 us)", network_link(100, rdma=True))
)
# NVIDIA's script uses Horovod, whose options (fusion, overlap, 32-bit gradients) are those above.
DGX_A100_OPTIONS = HOROVOD_OPTIONS
# Goyal et al. sec. 4: gradients of each layer aggregated as soon as backprop makes them,
# summed inside the server (NCCL), recursive halving and doubling across servers (Gloo).
BIG_BASIN_OPTIONS = Options(algorithm="halving_doubling", overlap=True, hierarchical=True)

_HOROVOD_128 = (
    "Horovod docs, Benchmarks page (docs/benchmarks.rst in horovod/horovod, same text in its README): "
    "128 servers x 4 Pascal GPUs, RoCE-capable 25 Gbit/s, tf_cnn_benchmarks --batch_size 64 --variable_update "
    "horovod: 90% Inception V3 and ResNet-101, 68% VGG-16. The paper (Sergeev & Del Balso 2018, arXiv:1802.05799) "
    "plots these runs; its figures were not checked number by number here (a summary of its text gives 88% at "
    "128 GPUs over TCP)."
)
_HOROVOD_32 = (
    "Horovod README of 2017 (e.g. the copy in github.com/alsrgv/horovod): 32 servers x 4 Pascal GPUs, "
    "RoCE-capable 25 Gbit/s: 90% Inception V3 and ResNet-101, 79% VGG-16; batch 64 per GPU as in the "
    "benchmark instructions. Not found in the paper's text; its figures were not checked."
)
_TF_DGX1 = (
    "TensorFlow benchmarks page (tensorflow/docs site/en/r1/guide/performance/benchmarks.md, May 2017): "
    "DGX-1, ResNet-50, batch 64 per GPU, synthetic data, variable_update=parameter_server, "
    "local_parameter_device=cpu: 219 images/s on 1 P100, 1734 on 8, efficiency 1734 / (8 x 219)."
)
_GOYAL = (
    "Goyal et al. 2017, Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour (arXiv:1706.02677), "
    "abstract: ~90% scaling efficiency from 8 to 256 GPUs, ResNet-50, 8192 images on 256 GPUs (32 per GPU); "
    "Big Basin servers of 8 P100 on NVLink, 50 Gbit/s Ethernet (sec. 4, not re-read for this table). "
    "One P100's speed is TensorFlow's, not the paper's Caffe2."
)

_NVIDIA_A100 = (
    "NVIDIA DeepLearningExamples, TensorFlow/Classification/ConvNets/resnet50v1.5/README.md, Training "
    "performance: NVIDIA DGX A100 (8x A100 40GB): batch 256 per GPU, real data averaged over an epoch, "
    "weak scaling 7.70x (TF32 + XLA) and 7.32x (AMP, mixed precision + XLA) on 8 GPUs."
)


def _published() -> tuple[Published, ...]:
    rows = []
    for servers, efficiencies, source in (
        (128, (0.90, 0.90, 0.68), _HOROVOD_128),
        (32, (0.90, 0.90, 0.79), _HOROVOD_32),
    ):
        for model, efficiency in zip(("Inception V3", "ResNet-101", "VGG-16"), efficiencies, strict=True):
            label = f"Horovod, {servers} x 4 GPUs"
            workload = p100_workload(model, 64)
            rows.append(
                Published(label, workload, 4 * servers, 1, efficiency, HOROVOD_CLUSTER, HOROVOD_OPTIONS, source)
            )
    rows.append(
        Published(
            "tf_cnn_benchmarks, DGX-1",
            p100_workload("ResNet-50", 64),
            8,
            1,
            1734 / (8 * 219),
            DGX1_HOST,
            DGX1_OPTIONS,
            _TF_DGX1,
        )
    )
    rows.append(
        Published(
            "Goyal et al., 32 x 8 GPUs",
            p100_workload("ResNet-50", 32),
            256,
            8,
            0.90,
            BIG_BASIN,
            BIG_BASIN_OPTIONS,
            _GOYAL,
        )
    )
    for precision, speedup in (("TF32", 7.70), ("AMP", 7.32)):
        workload = a100_resnet50(precision)
        rows.append(
            Published(
                "NVIDIA examples, DGX A100", workload, 8, 1, speedup / 8, DGX_A100, DGX_A100_OPTIONS, _NVIDIA_A100
            )
        )
    return tuple(rows)


PUBLISHED = _published()


def predict(row: Published, options: Options | None = None) -> float:
    """The model's efficiency for `row`, with the row's options or others."""
    options = row.options if options is None else options
    return cluster_efficiency(row.workload, row.gpus, row.system, options, baseline=row.baseline_gpus)


def explain(row: Published) -> dict[str, float]:
    """For each mechanism the row's system uses: the change in predicted efficiency, in
    points, when that one mechanism is switched off."""
    predicted = predict(row)
    return {term: 100 * (predict(row, switched_off(row.options, term)) - predicted) for term in terms_on(row.options)}


def published_table(rows=PUBLISHED) -> list[dict]:
    """One JSON-ready dict per published result: what was published, what the model predicts."""
    table = []
    for row in rows:
        predicted = predict(row)
        step = step_time(row.workload, row.gpus, row.system, row.options)
        table.append(
            {
                "system": row.label,
                "model": row.workload.model,
                "gpus": row.gpus,
                "baseline_gpus": row.baseline_gpus,
                "batch": row.workload.batch,
                "node": row.system.node.name,
                "network": row.system.network.name if row.system.network else "none (one node)",
                "published": row.efficiency,
                "predicted": predicted,
                "error_points": 100 * (predicted - row.efficiency),
                "step_ms": {k: 1e3 * getattr(step, k) for k in ("compute", "communication", "exposed")},
                "buckets": step.buckets,
                "options": dataclasses.asdict(row.options),
                "term_off_points": explain(row),
                "source": row.source,
                "model_source": row.workload.source,
            }
        )
    return table


def format_table(table: list[dict]) -> str:
    """The table as text: one line per result, its sources numbered below."""
    header = (
        f"{'system':27s} {'model':13s} {'GPUs':>9s} {'batch':>5s} {'published':>9s} {'predicted':>9s} {'error':>7s}"
    )
    lines, sources = [header, "-" * len(header)], []
    for r in table:
        if r["source"] not in sources:
            sources.append(r["source"])
        gpus = f"{r['baseline_gpus']}->{r['gpus']}"
        lines.append(
            f"{r['system']:27s} {r['model']:16s} {gpus:>9s} {r['batch']:5d} {r['published']:9.0%} "
            f"{r['predicted']:9.0%} {r['error_points']:+6.1f}  [{sources.index(r['source']) + 1}]"
        )
    lines.append("error: predicted minus published, in points of efficiency.")
    lines += [f"[{i}] {s}" for i, s in enumerate(sources, 1)]
    return "\n".join(lines)


def _writable_json_path(text: str) -> str:
    folder = Path(text).parent
    if not (folder.is_dir() and os.access(folder, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{text!r}: {folder} is not a writable folder; pass a path in one.")
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tutorial_lib.costmodel",
        description="The cost model held against published scaling results.",
    )
    parser.add_argument("--published", action="store_true", help="print published results beside the predictions")
    parser.add_argument("--json", type=_writable_json_path, metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    if not args.published:
        parser.error("nothing to do: pass --published (and --json PATH to keep the rows).")
    table = published_table()
    print(format_table(table))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": table}, f, indent=1)
        print(f"wrote {len(table)} rows to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
