"""Chunks past one per device: `SplitPipeline` runs the take-away's pipelined step (examples/pipeline_parallel.py,
notebook 05's deep dive) on S devices holding v chunks each, in the orders of `schedules.interleaved` (v model
chunks per device, Narayanan et al., SC'21), `schedules.zb_h1` (zero bubble, Qi et al., ICLR 2024), 1F1B, GPipe or
the sequential one, in ONE graph per step like `pipeline.Pipeline`, whose subclass it is. `make_chunks` cuts a
model's layers into S * v chunks. `pipeline_graph` reads what a traced step does: each device's executed order and
the activation bytes it keeps.
"""

from __future__ import annotations

import tensorflow as tf

from . import checks, models, pipeline, schedules
from .devices import normalize

SPLIT_SCHEDULES = ("sequential", "gpipe", "1f1b", "zb_h1", "interleaved")


def split_orders(S, M, kind, v=1):
    """Each device's order for `kind` (one of SPLIT_SCHEDULES) with v chunks per device."""
    if kind not in SPLIT_SCHEDULES:
        raise ValueError(f"schedule must be one of {SPLIT_SCHEDULES}, got {kind!r}.")
    if kind == "interleaved" and v < 2:
        raise ValueError(f"interleaving needs v >= 2 chunks per device, got {v} (one chunk is 1F1B): "
                         f"give {2 * S} chunks for {S} devices, or schedule='1f1b'.")  # fmt: skip
    if kind != "interleaved" and v != 1:
        raise ValueError(f"{kind} runs one chunk per device, got {v} per device: give {S} chunks, or "
                         "schedule='interleaved' for several chunks per device.")  # fmt: skip
    return schedules.orders_of(kind, S, M, v)


class SplitPipeline(pipeline.Pipeline):
    """Train `chunks` on `devices` (S of them): chunk k on devices[k % S], so S * v chunks give v
    per device. `schedule`: "zb_h1" (backwards split into B and W, W deferred), "interleaved"
    (v >= 2), or "gpipe" / "1f1b". `recompute=True` keeps only each chunk's input between its F
    and its backward. The rest is `pipeline.Pipeline`'s: SGD or an optimizer copied per chunk."""

    def __init__(self, chunks, devices, micro_batches, learning_rate=None, schedule="zb_h1",
                 loss_fn=models.cross_entropy, optimizer=None, recompute=False, wait_for_arrival=None):  # fmt: skip
        chunks, devices = list(chunks), [normalize(d) for d in checks.device_list(devices)]
        S = len(devices)
        if not chunks or len(chunks) % S:
            raise ValueError(f"got {len(chunks)} chunks for {S} devices: give v chunks per device (S * v chunks, "
                             "chunk k on device k mod S), e.g. make_chunks(...) with v=1 or v=2.")  # fmt: skip
        v = len(chunks) // S
        orders = split_orders(S, checks.whole_number(micro_batches, "micro_batches"), schedule, v)
        # Pipeline's checks, optimizer copies and step counter, per chunk, and its step on `orders`.
        super().__init__(chunks, [devices[k % S] for k in range(len(chunks))], micro_batches, learning_rate,
                         "gpipe", loss_fn, optimizer, wait_for_arrival, recompute)  # fmt: skip
        self.kind, self.orders, self.v, self.physical = schedule, orders, v, devices


def make_chunks(make_layer, n_layers, devices, v=1):
    """`n_layers` layers cut into S * v chunks (`models.Sequential`), chunk k's layers made by
    `make_layer(i)` under devices[k % S], so that their weights live there."""
    devices, n_layers = checks.device_list(devices), checks.whole_number(n_layers, "n_layers")
    n = len(devices) * checks.whole_number(v, "v")
    if n_layers % n:
        fits = n_layers + n - n_layers % n
        raise ValueError(f"{n_layers} layers do not cut into {len(devices)} devices x {v} chunks = {n} equal "
                         f"chunks: use a multiple of {n} layers (e.g. {fits}) or another v.")  # fmt: skip
    per, chunks = n_layers // n, []
    for k in range(n):
        with tf.device(devices[k % len(devices)]):
            chunks.append(models.Sequential([make_layer(i) for i in range(k * per, (k + 1) * per)]))
    return chunks
