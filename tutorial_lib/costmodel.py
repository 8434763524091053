"""Cost model of data-parallel training: the alpha-beta all-reduce, a step on one machine
(notebook 06), a step on a GPU cluster with the mechanisms of `Options`, and ZeRO's sharding
terms (notebook 08). Published results and the command line live in `published`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

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


# Bandwidths are public line rates (PCIe 3.0 x16 sustains about 12 of its 15.75 GB/s; NVLink 1:
# 20 GB/s per link and direction, NVIDIA's P100 whitepaper). Latencies are orders of magnitude,
# not measurements: 5 us over NVLink and RDMA, 10 us over PCIe, 25 us over TCP.
PCIE3 = AlphaBeta(alpha=10e-6, beta=1 / 12e9)
NVLINK_P100 = AlphaBeta(alpha=5e-6, beta=1 / 20e9)
NVLINK_A100 = AlphaBeta(alpha=5e-6, beta=1 / 150e9)  # 300 GB/s per direction, half sustained


def network_link(gbit_per_s: float, rdma: bool) -> AlphaBeta:
    """A node's network card at its line rate, with the latency of RDMA or of TCP."""
    return AlphaBeta(alpha=5e-6 if rdma else 25e-6, beta=8 / (gbit_per_s * 1e9))


# lesson: 06_scaling
ALLREDUCE_TERMS = {
    "ring": lambda n: (2 * (n - 1), 2 * (n - 1) / n),
    "halving_doubling": lambda n: (2 * int(np.ceil(np.log2(n))), 2 * (n - 1) / n),
    "central": lambda n: (2 * (n - 1), 2 * (n - 1)),
}


# lesson: 06_scaling
def allreduce_seconds(num_bytes, n, link, algorithm="ring"):
    """One all-reduce of `num_bytes` over `n` devices: its messages, sent one after another, times
    alpha, plus the bytes through its busiest link times beta."""
    messages, per_byte = ALLREDUCE_TERMS[algorithm](n)
    return messages * link.alpha + per_byte * num_bytes * link.beta


# lesson: 06_scaling
def step_seconds(compute, per_device_batch, n, gradient_bytes, link, algorithm="ring"):
    """One data-parallel step: compute on the per-device batch, then the all-reduce of the gradients."""
    work = compute.fixed + compute.per_example * per_device_batch
    return work + allreduce_seconds(gradient_bytes, n, link, algorithm)


def _coefficients(n: int, algorithm: str) -> tuple[float, float]:
    """(messages, bytes per byte of the tensor) of `algorithm` over `n` devices, or a clear error."""
    if algorithm not in ALLREDUCE_TERMS:
        raise ValueError(f"algorithm must be one of {', '.join(map(repr, ALLREDUCE_TERMS))}, got {algorithm!r}.")
    return ALLREDUCE_TERMS[algorithm](checks.whole_number(n, "n (the number of devices)"))


def allreduce_time(num_bytes: float, n: int, link: AlphaBeta, algorithm: str = "ring") -> float:
    """`allreduce_seconds` with its arguments checked (0 on one device)."""
    _coefficients(n, algorithm)
    return allreduce_seconds(_nonnegative(num_bytes, "num_bytes"), n, link, algorithm)


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


# --- GPU clusters: nodes, a network, and the mechanisms that hide or shrink the all-reduce ---


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
    """`system` with every link's latency multiplied by `latency` and its bandwidth by `bandwidth`."""
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
    """The mechanisms a framework uses; `TERMS` are the ones a reader switches off one by one."""

    algorithm: str = "ring"  # across nodes, or flat over all GPUs (see `cluster_allreduce_time`)
    overlap: bool = False  # all-reduce each bucket as soon as the backward pass has made it
    fusion: bool = False  # pack small tensors into buckets of `bucket_bytes`
    hierarchical: bool = False  # reduce-scatter in the node, all-reduce across, all-gather in the node
    gradient_bits: int = 32  # 16: half the bytes
    bucket_bytes: float = 64 * 2**20  # Horovod's fusion threshold of 2017; DDP's is 25 MB
    backward_share: float = 2 / 3  # backward = 2 x forward in FLOPs (Kaplan et al. 2020, arXiv:2001.08361)

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
    """Seconds of one all-reduce over `n` GPUs: inside a node over its link; across nodes flat at
    the network card's speed, or hierarchical (a ring in each node, then `options.algorithm` across
    nodes: the same bytes through the card, 2(n/g - 1) messages instead of 2(n - 1))."""
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
    """Bytes of each all-reduce of a step, in backward order: tensors of equal size (a simplification),
    each alone, or with fusion sharing buckets of at most `options.bucket_bytes`."""
    tensors = checks.whole_number(tensors, "tensors")
    size = _nonnegative(gradient_bytes, "gradient_bytes") / tensors
    per_bucket = 1
    if options.fusion:
        per_bucket = tensors if size == 0 else min(tensors, max(1, int(options.bucket_bytes // size)))
    full, rest = divmod(tensors, per_bucket)
    return [per_bucket * size] * full + [rest * size] * (rest > 0)


def exposed_communication(bucket_seconds, bucket_bytes, backward_seconds: float, overlap: bool) -> float:
    """Seconds of all-reduce the step waits for after its backward pass: all of it without overlap;
    with overlap (gradients made at an even rate) what runs past the end of the pass."""
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


# --- sharding (notebook 08): model state per device and bytes sent per device per step ---

ZERO_SHARDED = {0: (), 1: ("optimizer",), 2: ("optimizer", "grads"), 3: ("optimizer", "grads", "params")}
SHARDINGS = ("data parallel", "ZeRO-1", "ZeRO-2", "ZeRO-3", "tensor parallel")


def _stage(stage) -> int:
    if isinstance(stage, bool) or stage not in ZERO_SHARDED:
        raise ValueError(f"stage must be 0 (data parallelism), 1, 2 or 3, got {stage!r}.")
    return stage


def zero_memory(parameters, n, stage, k=12) -> float:
    """Bytes of model state per device under ZeRO `stage` (0: data parallelism), mixed-precision
    Adam: (2 + 2 + K) Psi, each part the stage shards divided by n (arXiv:1910.02054, sec. 5)."""
    psi, n, sharded = _nonnegative(parameters, "parameters"), checks.whole_number(n, "n"), ZERO_SHARDED[_stage(stage)]
    parts = {"params": 2, "grads": 2, "optimizer": k}
    return sum(psi * size / (n if part in sharded else 1) for part, size in parts.items())


def zero_traffic(parameters, n, stage) -> float:
    """16-bit bytes each device sends per step: a reduce-scatter and an all-gather, (n-1)/n Psi each;
    stage 3 gathers the weights twice (the paper's 3 Psi, 1.5 times)."""
    halves = 3 if _stage(stage) == 3 else 2
    n = checks.whole_number(n, "n")
    return halves * (n - 1) / n * _nonnegative(parameters, "parameters") * 2


def tensor_parallel_traffic(activation_elements, n, layers) -> float:
    """16-bit bytes each device sends per step in Megatron-LM (arXiv:1909.08053, sec. 3): per layer
    2 all-reduces forward and 2 backward of the activation, 2(n-1)/n of it each."""
    n, layers = checks.whole_number(n, "n"), checks.whole_number(layers, "layers")
    return layers * 4 * 2 * (n - 1) / n * _nonnegative(activation_elements, "activation_elements") * 2


def sharding_table(parameters, n, link, activation_elements, layers) -> list[dict]:
    """Per method of `SHARDINGS`: model state per device, and bytes and seconds (bytes x beta) sent
    per step; tensor parallelism splits all the state n ways; activations are not counted."""
    rows = []
    for method in SHARDINGS:
        if method == "tensor parallel":
            memory = zero_memory(parameters, n, 3)
            sent = tensor_parallel_traffic(activation_elements, n, layers)
        else:
            stage = SHARDINGS.index(method)
            memory, sent = zero_memory(parameters, n, stage), zero_traffic(parameters, n, stage)
        rows.append({"method": method, "memory_bytes": memory, "bytes_sent": sent, "seconds": sent * link.beta})
    return rows


if __name__ == "__main__":  # python -m tutorial_lib.costmodel --published
    import sys

    from tutorial_lib.published import main

    sys.exit(main())
