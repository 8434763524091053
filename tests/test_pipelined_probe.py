"""Faults found probing examples/train_pipelined.py and pipeline_*.py as a careless reader would (issue 51's families
on the new layout), each kept as a test."""

import keras
import numpy as np
import pipeline_checks


def test_recompute_takes_a_model_with_a_frozen_layer():
    frozen = keras.layers.Dense(16)
    frozen.trainable = False  # a reader's pretrained block, kept fixed
    model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(), frozen, keras.layers.Dense(10)])
    assert pipeline_checks.model_problem(model, np.zeros((4, 8, 8, 1), np.float32), recompute=True) is None


def test_recompute_refuses_a_model_whose_forward_writes_its_state():
    class Counter(keras.layers.Layer):  # a layer that counts its calls: a forward run twice counts twice
        def build(self, _shape):
            self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False, name="calls")

        def call(self, h):
            self.calls.assign_add(1.0)
            return h

    model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(), Counter(), keras.layers.Dense(10)])
    problem = pipeline_checks.model_problem(model, np.zeros((4, 8, 8, 1), np.float32), recompute=True)
    assert "calls would change twice" in problem
    assert float(model.layers[1].calls) == 0.0  # the probe put it back
