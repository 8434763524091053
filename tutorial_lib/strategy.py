"""TensorFlow's own route: `MirroredStrategy` in a custom training loop. The take-away's `mirrored_strategy`
(collective keys of its own, so that several strategies share a process) and `mirrored_train_step` (notebook
03's step, k steps a call from a distributed iterator), which `multi_worker` also runs: examples/data_parallel.py.
"""

from data_parallel import mirrored_strategy, mirrored_train_step  # noqa: F401 (the take-away's: one copy)
