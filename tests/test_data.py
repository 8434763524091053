import numpy as np
import pytest

from tutorial_lib import data


def test_load_digits_shapes_ranges_and_split():
    (x_train, y_train), (x_test, y_test) = data.load_digits()
    assert x_train.shape == (1497, 8, 8, 1) and x_test.shape == (300, 8, 8, 1)
    assert x_train.dtype == np.float32 and y_train.dtype == np.int32
    assert 0.0 <= x_train.min() and x_train.max() <= 1.0
    assert set(np.unique(y_train)) == set(range(10))
    # train and test are disjoint rows of the same 1,797 digits
    rows = {r.tobytes() for r in x_train.reshape(len(x_train), -1)}
    overlap = sum(r.tobytes() in rows for r in x_test.reshape(len(x_test), -1))
    assert overlap < 5  # a few digits occur twice in the raw data set


def test_load_digits_is_deterministic_and_seeded():
    (a, _), _ = data.load_digits(seed=0)
    (b, _), _ = data.load_digits(seed=0)
    (c, _), _ = data.load_digits(seed=1)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_make_dataset_batches_evenly():
    x = np.arange(10, dtype=np.float32)
    y = np.arange(10, dtype=np.int32)
    batches = list(data.make_dataset(x, y, batch_size=4, shuffle=False))
    assert [len(b[0]) for b in batches] == [4, 4]
    kept = list(data.make_dataset(x, y, batch_size=4, shuffle=False, drop_remainder=False))
    assert [len(b[0]) for b in kept] == [4, 4, 2]
    shuffled = np.concatenate([b[0] for b in data.make_dataset(x, y, 5, seed=3)])
    assert sorted(shuffled) == list(x) and list(shuffled) != list(x)


def test_make_dataset_rejects_impossible_batches():
    x = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match="larger than the 3 examples"):
        data.make_dataset(x, x, batch_size=8)
    with pytest.raises(ValueError, match="batch_size must be a whole number >= 1"):
        data.make_dataset(x, x, batch_size=0)


@pytest.mark.parametrize("batch_size", [0, 2.5, True])
def test_make_dataset_refuses_a_batch_size_that_is_not_a_whole_number(batch_size):
    x, y = np.zeros((8, 2), np.float32), np.zeros(8, np.int32)
    with pytest.raises(ValueError, match="batch_size must be a whole number >= 1"):
        data.make_dataset(x, y, batch_size=batch_size)


def test_make_dataset_takes_a_numpy_batch_size():
    x, y = np.zeros((8, 2), np.float32), np.zeros(8, np.int32)
    assert len(list(data.make_dataset(x, y, batch_size=np.int64(4), shuffle=False))) == 2


def test_random_batch_is_seeded_and_shaped():
    x, y = data.random_batch(6, seed=1)
    assert x.shape == (6, 8, 8, 1) and x.dtype.name == "float32" and y.dtype.name == "int32"
    assert 0 <= float(np.min(x)) and float(np.max(x)) < 1 and set(y.numpy()) <= set(range(10))
    np.testing.assert_array_equal(data.random_batch(6, seed=1)[0], x)
    with pytest.raises(ValueError, match="examples must be a whole number"):
        data.random_batch(0)
