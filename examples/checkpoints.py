"""--checkpoint DIR for train_multi_gpu.py: the model, its optimizer, the steps done and the run's settings, saved as
DIR/ckpt-N; a resume takes the newest that reads whole and refuses one that does not fit this run."""

import json
from pathlib import Path

import common  # noqa: F401 (first: it imports TensorFlow with its start-up lines filtered)
import tensorflow as tf
from common import refuse

SETTINGS = "settings/.ATTRIBUTES/VARIABLE_VALUE"  # the run's settings in a checkpoint of Checkpoints


class Checkpoints:
    """--checkpoint DIR: a model, its optimizer and the steps done, saved as DIR/ckpt-N (N: steps done) with the
    run's settings; the two newest kept. A resume takes the newest that reads whole, naming any damaged one it
    passes, and refuses one saved with other settings or from another model. No DIR: nothing saved."""

    def __init__(self, folder):
        self.folder, self.done, self.saved = Path(folder) if folder else None, 0, None
        if self.folder:  # now, not after an epoch of training
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                (self.folder / ".writable").write_text("")
                (self.folder / ".writable").unlink()
            except OSError as err:
                refuse(f"--checkpoint {folder}: cannot write there ({err.strerror}); give a folder you can write")

    def newest_first(self):
        found = [(int(p.name[5:-6]), p) for p in self.folder.glob("ckpt-*.index") if p.name[5:-6].isdigit()]
        return [str(p)[: -len(".index")] for _, p in sorted(found, reverse=True)]

    def restore(self, model, optimizer, settings):
        """Restore the newest intact checkpoint of DIR into model and optimizer (self.done: its steps)."""
        if not self.folder:
            return
        self.steps, self.settings = tf.Variable(0, dtype=tf.int64), tf.Variable(json.dumps(settings))
        self.saved = tf.train.Checkpoint(model=model, optimizer=optimizer, steps=self.steps, settings=self.settings)
        for prefix in self.newest_first():
            try:
                reader = tf.train.load_checkpoint(prefix)
                ours = reader.has_tensor(SETTINGS)  # tf.train.CheckpointManager's files are ckpt-N too
                kept = json.loads(reader.get_tensor(SETTINGS)) if ours else None
            except (tf.errors.OpError, ValueError, KeyError, IndexError) as err:  # cut short
                print(f"checkpoint: {prefix} is damaged ({type(err).__name__}); trying an older one")
                continue
            if not ours:  # not to pass over, then overwrite or delete as older than the two newest
                refuse(f"--checkpoint {self.folder}: {prefix} was not saved by this program (it holds no run "
                       "settings); give an empty folder, or the one this program saved into")  # fmt: skip
            if other := {k: (kept.get(k), v) for k, v in settings.items() if kept.get(k) != v}:
                said = ", ".join(f"--{k.replace('_', '-')} {a} (this run: {b})" for k, (a, b) in other.items())
                refuse(f"--checkpoint {self.folder}: {prefix} was saved with {said}; give those, or an empty folder")
            try:
                self.saved.read(prefix).assert_existing_objects_matched()
            except (AssertionError, ValueError, tf.errors.InvalidArgumentError) as err:  # other variables or shapes
                refuse(f"--checkpoint {self.folder}: {prefix} was saved from another model ({str(err)[:150]}); give "
                       "the model that saved it, or an empty folder")  # fmt: skip
            except (tf.errors.OpError, IndexError) as err:
                print(f"checkpoint: {prefix} is damaged ({type(err).__name__}); trying an older one")
                continue
            self.done = int(self.steps)
            print(f"checkpoint: resumed from {prefix}, {self.done} steps done")
            return

    def save(self, done):
        if self.saved:
            self.steps.assign(done)
            print(f"checkpoint: {self.saved.write(str(self.folder / f'ckpt-{done}'))}")
            for old in self.newest_first()[2:]:
                for path in self.folder.glob(Path(old).name + ".*"):
                    path.unlink()
