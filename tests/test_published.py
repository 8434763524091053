"""Published scaling results: each held to its source, predicted by the cost model, and the command line."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tutorial_lib import published

ROOT = Path(__file__).resolve().parents[1]


def test_each_published_figure_is_the_one_its_source_quotes():
    for row in published.PUBLISHED:
        quoted = {
            "Horovod": f"{row.efficiency:.0%}",
            "tf_cnn_benchmarks": "1734",
            "Goyal": "~90%",
            "NVIDIA": f"{8 * row.efficiency:.2f}x",
        }
        (key,) = [k for k in quoted if row.label.startswith(k)]
        assert quoted[key] in row.source, (row.label, row.workload.model)
        plain = [text.lower().replace("-", "").replace(" ", "") for text in (row.workload.model.split()[0], row.source)]
        assert plain[0] in plain[1], (row.label, row.workload.model)  # the source is about this model
        assert "keras.applications" in row.workload.source


def test_one_set_of_assumptions_per_published_system():
    systems = {}
    for row in published.PUBLISHED:
        systems.setdefault(row.label.split(",")[0], set()).add((row.system, row.options))
    assert all(len(assumptions) == 1 for assumptions in systems.values()), systems


def test_every_published_result_is_predicted_within_10_points():
    for row in published.published_table():
        assert abs(row["error_points"]) <= 10, row


def test_published_speeds_come_from_the_named_table():
    seconds, source = published.p100_seconds_per_example("ResNet-50", 64)
    assert seconds == 1 / 219 and "benchmarks page" in source
    r101, source = published.p100_seconds_per_example("ResNet-101", 64)
    assert "interpolated" in source
    # halfway in multiply-adds (3.8 -> 7.6 -> 11.3 billion): close to halfway in time
    assert r101 == pytest.approx(1 / 219 + (7.6 - 3.8) / (11.3 - 3.8) * (1 / 91.8 - 1 / 219))
    with pytest.raises(ValueError, match="no published P100 speed for 'AlexNet'"):
        published.p100_seconds_per_example("AlexNet", 512)
    with pytest.raises(ValueError, match="precision must be one of"):
        published.a100_resnet50("fp8")


def test_explain_reports_what_each_mechanism_is_worth():
    vgg = next(r for r in published.PUBLISHED if r.label == "Horovod, 128 x 4 GPUs" and r.workload.model == "VGG-16")
    terms = published.explain(vgg)
    assert set(terms) == {"overlap", "fusion"}
    assert terms["overlap"] < 0  # without overlap the all-reduce is all exposed
    off = published.predict(vgg, published.switched_off(vgg.options, "overlap"))
    assert terms["overlap"] == pytest.approx(100 * (off - published.predict(vgg)))


@pytest.mark.slow
def test_model_figures_match_keras_applications():
    import keras

    # VGG-16 is left out: building its 138M parameters takes 20 s here (counted once: 138,357,544 in 32 tensors)
    for name, build in (("ResNet-50", "ResNet50"), ("ResNet-101", "ResNet101"), ("Inception V3", "InceptionV3")):
        model = getattr(keras.applications, build)(weights=None)
        figures = published.MODEL_FIGURES[name]
        assert len(model.trainable_weights) == figures["tensors"]
        assert sum(int(np.prod(w.shape)) for w in model.trainable_weights) == figures["parameters"]


def test_cli_prints_the_table_and_writes_json(tmp_path, capsys):
    path = tmp_path / "published.json"
    assert published.main(["--published", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "Horovod, 128 x 4 GPUs" in out and "arXiv:1706.02677" in out and f"wrote 10 rows to {path}" in out
    rows = json.loads(path.read_text())["rows"]
    assert len(rows) == len(published.PUBLISHED)
    for row in rows:
        assert {"source", "published", "predicted", "model", "gpus", "batch", "network"} <= set(row)
        assert 0 < row["published"] <= 1 and 0 < row["predicted"] <= 1
        assert row["error_points"] == pytest.approx(100 * (row["predicted"] - row["published"]))
    assert list(tmp_path.iterdir()) == [path]


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "nothing to do: pass --published"),
        (["--published", "--json", "/nonexistent-dir/x.json"], "not a writable folder"),
        (["--published", "--json", ""], "--json needs a file name"),
        (["--published", "--json", "{folder}"], "is a folder; give a file name in it, such as"),
    ],
)
def test_cli_refuses_bad_arguments_without_a_traceback(args, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        published.main([a.format(folder=tmp_path) for a in args])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow
def test_cli_runs_as_the_cost_models_module(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "tutorial_lib.costmodel", "--published"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "Goyal et al." in done.stdout and "error: predicted minus published" in done.stdout


def test_zero_figure_1_and_megatrons_efficiency_are_reproduced():
    for stage, (published_gb, predicted_gb) in published.zero_figure_1().items():
        assert round(predicted_gb, 2 if published_gb < 10 else 1) == published_gb, stage
    assert round(published.megatron_efficiency(), 2) == published.MEGATRON_ABSTRACT["efficiency"]
