"""A cost model of data-parallel and pipelined training, to fit to measurements and extrapolate.

- All-reduce, the alpha-beta model: a message costs alpha (latency) plus bytes x beta
  (seconds per byte). A ring all-reduce of S bytes over N devices sends 2(N-1) messages of
  S/N bytes one after another: t = 2(N-1) alpha + 2(N-1)/N S beta. A central one sends
  N-1 tensors in and N-1 out through one link: t = 2(N-1) (alpha + S beta).
- A data-parallel step: compute (seconds per example x per-device batch, plus a fixed
  cost), then the all-reduce of the gradients, not overlapped (a pessimistic assumption,
  stated so that it can be checked).
- A pipeline: (M+S-1)/M times the work of one stage, plus a fixed cost per tick.

`fit_alpha_beta` and `fit_compute` take this machine's measurements; `predict_*` then use
the fitted parameters, or a `Hardware` description for machines we do not have.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import checks


@dataclass(frozen=True)
class AlphaBeta:
    alpha: float  # seconds per message
    beta: float  # seconds per byte


@dataclass(frozen=True)
class Compute:
    per_example: float  # seconds per example on one device
    fixed: float  # seconds per step whatever the batch


@dataclass(frozen=True)
class Hardware:
    """Assumptions for a machine we cannot measure; every number is stated, none is hidden."""

    name: str
    flops: float  # sustained floating-point operations per second per device
    link: AlphaBeta  # the slowest link an all-reduce crosses

    def compute(self, flops_per_example: float, fixed: float = 0.0) -> Compute:
        return Compute(flops_per_example / self.flops, fixed)


# Round numbers of public specifications, discounted to what training sustains.
GPU_NODE = Hardware(
    "8 GPUs on NVLink (A100 class: 100 TFLOP/s sustained, 150 GB/s, 10 us)",
    flops=100e12,
    link=AlphaBeta(alpha=10e-6, beta=1 / 150e9),
)
GPU_CLUSTER = Hardware(
    "GPU nodes on 100 Gb/s InfiniBand (12.5 GB/s, 20 us per message)",
    flops=100e12,
    link=AlphaBeta(alpha=20e-6, beta=1 / 12.5e9),
)


# Each all-reduce over n devices as (messages sent one after another, bytes through the
# busiest link per byte of the tensor): t = messages x alpha + per_byte x S x beta.
_ALGORITHMS = {
    "ring": lambda n: (2 * (n - 1), 2 * (n - 1) / n),
    "central": lambda n: (2 * (n - 1), 2 * (n - 1)),
}
ALGORITHMS = tuple(_ALGORITHMS)


def _coefficients(n: int, algorithm: str) -> tuple[float, float]:
    """(messages, per_byte) of `algorithm` over `n` devices, or a clear error."""
    if algorithm not in _ALGORITHMS:
        raise ValueError(f"algorithm must be {' or '.join(map(repr, ALGORITHMS))}, got {algorithm!r}.")
    return _ALGORITHMS[algorithm](checks.whole_number(n, "n (the number of devices)"))


def allreduce_time(num_bytes: float, n: int, link: AlphaBeta, algorithm: str = "ring") -> float:
    """Predicted seconds of one all-reduce of `num_bytes` over `n` devices (0 on one device)."""
    messages, per_byte = _coefficients(n, algorithm)
    return messages * link.alpha + per_byte * num_bytes * link.beta


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
