"""Published scaling results with their sources, beside the cost model's predictions (none fitted
to them), and the command line ``python -m tutorial_lib.costmodel --published [--json PATH]``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from .costmodel import (
    NVLINK_A100,
    NVLINK_P100,
    PCIE3,
    Network,
    Node,
    Options,
    System,
    Workload,
    cluster_efficiency,
    network_link,
    switched_off,
    terms_on,
    zero_memory,
)

# Trainable parameters and tensors, counted on keras.applications.<Model>(weights=None) (checked
# by a slow test; tf_cnn_benchmarks' versions differ by a few biases). Forward multiply-adds per
# 224x224 image: He et al. 2016 (arXiv:1512.03385), Table 1.
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
    """Seconds per image on one P100 and where the figure comes from. The page has no ResNet-101:
    its time is interpolated in multiply-adds between ResNet-50 and ResNet-152 at batch 64."""
    if (model, batch) in P100_IMAGES_PER_S:
        return 1 / P100_IMAGES_PER_S[model, batch], f"{_SPEED_SOURCE}, batch {batch}"
    if model == "ResNet-101" and batch == 64:
        f50, f101, f152 = (MODEL_FIGURES[m]["multiply_adds"] for m in ("ResNet-50", "ResNet-101", "ResNet-152"))
        t50, t152 = 1 / P100_IMAGES_PER_S["ResNet-50", 64], 1 / P100_IMAGES_PER_S["ResNet-152", 64]
        seconds = t50 + (f101 - f50) / (f152 - f50) * (t152 - t50)
        return seconds, f"{_SPEED_SOURCE}, interpolated in multiply-adds between ResNet-50 and ResNet-152, batch 64"
    raise ValueError(f"no published P100 speed for {model!r} at batch {batch}; known: {sorted(P100_IMAGES_PER_S)}.")


def _workload(name: str, model: str, seconds: float, batch: int, speed_source: str) -> Workload:
    figures, source = MODEL_FIGURES[model], f"parameters and tensors of keras.applications; {speed_source}"
    return Workload(name, figures["parameters"], figures["tensors"], seconds, batch, source)


def p100_workload(model: str, batch: int) -> Workload:
    seconds, speed_source = p100_seconds_per_example(model, batch)
    return _workload(model, model, seconds, batch, speed_source)


# Images per second on ONE A100 40GB, ResNet-50 v1.5 (ResNet-50's parameters), batch 256, real
# data averaged over an epoch: NVIDIA DeepLearningExamples,
# TensorFlow/Classification/ConvNets/resnet50v1.5/README.md, "Training performance: NVIDIA DGX A100".
A100_IMAGES_PER_S = {"TF32": 909.0, "AMP": 2375.0}  # AMP: automatic mixed precision


def a100_resnet50(precision: str) -> Workload:
    if precision not in A100_IMAGES_PER_S:
        raise ValueError(f"precision must be one of {sorted(A100_IMAGES_PER_S)}, got {precision!r}.")
    source = (
        "one A100's images/s from NVIDIA DeepLearningExamples "
        f"(ResNet-50 v1.5, TensorFlow, {precision} + XLA, batch 256, real data)"
    )
    return _workload(f"ResNet-50 {precision}", "ResNet-50", 1 / A100_IMAGES_PER_S[precision], 256, source)


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
# backward pass makes it, tensor fusion up to 64 MB (its docs, tensor-fusion.rst); buckets of the
# threshold's size stand in for what is fused per cycle. Its hierarchical all-reduce came in 2018.
HOROVOD_OPTIONS = Options(algorithm="ring", overlap=True, fusion=True)
DGX1_HOST = System(
    Node("DGX-1, 8 P100, gradients to a parameter server on the host CPU over PCIe 3.0 x16 (12 GB/s, 10 us)", 8, PCIE3)
)
# variable_update=parameter_server, local_parameter_device=cpu: each gradient goes to the host as
# soon as it exists, one transfer per tensor; "central" over one PCIe link is a pessimistic
# stand-in for the host's several links.
DGX1_OPTIONS = Options(algorithm="central", overlap=True)
BIG_BASIN = System(
    Node("Big Basin server, 8 P100 on NVLink (20 GB/s, 5 us)", 8, NVLINK_P100),
    Network("50 Gbit/s Ethernet, TCP (6.25 GB/s, 25 us)", network_link(50, rdma=False)),
)
# Goyal et al. sec. 4: gradients of each layer aggregated as soon as backprop makes them,
# summed inside the server (NCCL), recursive halving and doubling across servers (Gloo).
BIG_BASIN_OPTIONS = Options(algorithm="halving_doubling", overlap=True, hierarchical=True)
DGX_A100 = System(Node("DGX A100, 8 A100 on NVLink and NVSwitch (150 GB/s, 5 us)", 8, NVLINK_A100))
# For extrapolating: such nodes joined by one 100 Gbit/s InfiniBand card each (many have more).
A100_CLUSTER = System(
    DGX_A100.node, Network("100 Gbit/s InfiniBand, one card per node (12.5 GB/s, 5 us)", network_link(100, rdma=True))
)


def _runs(run, results, source) -> list[Published]:
    """One `Published` per (workload, efficiency) of `results`; `run` is (label, GPUs, baseline GPUs,
    system, options), shared by the results of one publication."""
    label, gpus, baseline, system, options = run
    return [Published(label, w, gpus, baseline, e, system, options, source) for w, e in results]


_HOROVOD_MODELS = [p100_workload(model, 64) for model in ("Inception V3", "ResNet-101", "VGG-16")]
PUBLISHED = (
    *_runs(
        ("Horovod, 128 x 4 GPUs", 512, 1, HOROVOD_CLUSTER, HOROVOD_OPTIONS),
        zip(_HOROVOD_MODELS, (0.90, 0.90, 0.68), strict=True),
        "Horovod docs, Benchmarks page (docs/benchmarks.rst in horovod/horovod): 128 servers x 4 Pascal GPUs, "
        "RoCE-capable 25 Gbit/s, tf_cnn_benchmarks --batch_size 64 --variable_update horovod: 90% Inception V3 "
        "and ResNet-101, 68% VGG-16. The paper (Sergeev & Del Balso 2018, arXiv:1802.05799) plots these runs.",
    ),
    *_runs(
        ("Horovod, 32 x 4 GPUs", 128, 1, HOROVOD_CLUSTER, HOROVOD_OPTIONS),
        zip(_HOROVOD_MODELS, (0.90, 0.90, 0.79), strict=True),
        "Horovod README and docs of 2017 (the 128-GPU benchmark, e.g. github.com/alsrgv/horovod): 32 servers x 4 "
        "Pascal GPUs, RoCE-capable 25 Gbit/s: 90% Inception V3 and ResNet-101, 79% VGG-16; batch 64 per GPU as in "
        "its benchmark instructions.",
    ),
    *_runs(
        ("tf_cnn_benchmarks, DGX-1", 8, 1, DGX1_HOST, DGX1_OPTIONS),
        [(p100_workload("ResNet-50", 64), 1734 / (8 * 219))],
        "TensorFlow benchmarks page (tensorflow/docs site/en/r1/guide/performance/benchmarks.md, May 2017): "
        "DGX-1, ResNet-50, batch 64 per GPU, synthetic data, variable_update=parameter_server, "
        "local_parameter_device=cpu: 219 images/s on 1 P100, 1734 on 8, efficiency 1734 / (8 x 219).",
    ),
    *_runs(
        ("Goyal et al., 32 x 8 GPUs", 256, 8, BIG_BASIN, BIG_BASIN_OPTIONS),
        [(p100_workload("ResNet-50", 32), 0.90)],
        "Goyal et al. 2017, Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour (arXiv:1706.02677): "
        "~90% scaling efficiency from 8 to 256 GPUs (abstract), ResNet-50, 8192 images on 256 GPUs (32 per GPU); "
        "Big Basin servers of 8 P100 on NVLink, 50 Gbit/s Ethernet (sec. 4). One P100's speed is TensorFlow's, "
        "not the paper's Caffe2.",
    ),
    *_runs(  # NVIDIA's script uses Horovod, with Horovod's options (fusion, overlap, 32-bit gradients)
        ("NVIDIA examples, DGX A100", 8, 1, DGX_A100, HOROVOD_OPTIONS),
        [(a100_resnet50("TF32"), 7.70 / 8), (a100_resnet50("AMP"), 7.32 / 8)],
        "NVIDIA DeepLearningExamples, TensorFlow/Classification/ConvNets/resnet50v1.5/README.md, Training "
        "performance: NVIDIA DGX A100 (8x A100 40GB): batch 256 per GPU, real data averaged over an epoch, "
        "weak scaling 7.70x (TF32 + XLA) and 7.32x (AMP, mixed precision + XLA) on 8 GPUs.",
    ),
)


def predict(row: Published, options: Options | None = None) -> float:
    """The model's efficiency for `row`, with the row's options or others."""
    options = row.options if options is None else options
    return cluster_efficiency(row.workload, row.gpus, row.system, options, baseline=row.baseline_gpus)


def explain(row: Published) -> dict[str, float]:
    """For each mechanism the row's system uses: the change in predicted efficiency, in points,
    when that one mechanism is switched off."""
    predicted = predict(row)
    return {term: 100 * (predict(row, switched_off(row.options, term)) - predicted) for term in terms_on(row.options)}


def published_table(rows=PUBLISHED) -> list[dict]:
    """One JSON-ready dict per published result: what was published, what the model predicts."""
    table = []
    for row in rows:
        predicted = predict(row)
        table.append(
            {
                "system": row.label,
                "model": row.workload.model,
                "gpus": row.gpus,
                "baseline_gpus": row.baseline_gpus,
                "batch": row.workload.batch,
                "network": row.system.network.name if row.system.network else "none (one node)",
                "published": row.efficiency,
                "predicted": predicted,
                "error_points": 100 * (predicted - row.efficiency),
                "source": row.source,
                "model_source": row.workload.source,
            }
        )
    return table


def format_table(table: list[dict]) -> str:
    """The table as text: one line per result, its sources numbered below."""
    header = (
        f"{'system':27s} {'model':16s} {'GPUs':>9s} {'batch':>5s} {'published':>9s} {'predicted':>9s} {'error':>7s}"
    )
    lines, sources = [header, "-" * len(header)], []
    for r in table:
        if r["source"] not in sources:
            sources.append(r["source"])
        gpus = f"{r['baseline_gpus']}->{r['gpus']}"
        lines.append(
            f"{r['system']:27s} {r['model']:16s} {gpus:>9s} {r['batch']:5d} {r['published']:9.0%} "
            f"{r['predicted']:9.0%} {r['error_points']:+7.1f}  [{sources.index(r['source']) + 1}]"
        )
    lines.append("error: predicted minus published, in points of efficiency.")
    lines += [f"[{i}] {s}" for i, s in enumerate(sources, 1)]
    return "\n".join(lines)


# Sharding. ZeRO (Rajbhandari et al. 2020, arXiv:1910.02054), Figure 1: a 7.5-billion-parameter
# model, mixed-precision Adam (K = 12), on 64 devices: model state per device in GB (1e9 bytes).
ZERO_FIGURE_1 = {"parameters": 7.5e9, "devices": 64, "k": 12, "gb": {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.88}}
# Megatron-LM (Shoeybi et al. 2019, arXiv:1909.08053), abstract: "We sustain 15.1 PetaFLOPs across
# the entire application with 76% scaling efficiency when compared to a strong single GPU baseline
# that sustains 39 TeraFLOPs" (8.3 billion parameters, 512 V100 GPUs: 8-way tensor parallel x 64).
MEGATRON_ABSTRACT = {"petaflops": 15.1, "gpus": 512, "baseline_teraflops": 39.0, "efficiency": 0.76}


def zero_figure_1() -> dict[int, tuple[float, float]]:
    """Per stage: (published GB per device, the cost model's GB) for ZeRO's Figure 1."""
    f = ZERO_FIGURE_1
    return {
        stage: (gb, zero_memory(f["parameters"], f["devices"], stage, k=f["k"]) / 1e9) for stage, gb in f["gb"].items()
    }


def megatron_efficiency() -> float:
    """Megatron's scaling efficiency recomputed from its own figures: throughput / (GPUs x one GPU's)."""
    m = MEGATRON_ABSTRACT
    return m["petaflops"] * 1e3 / (m["gpus"] * m["baseline_teraflops"])


def main(argv=None) -> int:
    from .bench.rows import json_path_problem, write_json

    parser = argparse.ArgumentParser(
        prog="python -m tutorial_lib.costmodel", description="The cost model held against published scaling results."
    )
    parser.add_argument("--published", action="store_true", help="print published results beside the predictions")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON to the file PATH")
    args = parser.parse_args(argv)
    if not args.published:
        parser.error("nothing to do: pass --published (and --json PATH to keep the rows).")
    if args.json is not None and (problem := json_path_problem(args.json)):
        parser.error(problem)
    table = published_table()
    print(format_table(table))
    if args.json is not None:
        write_json(args.json, {"rows": table})
        print(f"wrote {len(table)} rows to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
