"""`smp.CheckpointManager`: numbered, complete, layout-free checkpoints.

smp_tf's variables are the model's own variables, only placed on other
devices, so a ``tf.train.Checkpoint`` of the model and its optimizer does not
depend on the partitioning: a checkpoint written with 2 partitions restores
with 4, with another schedule, or in plain Keras without smp_tf.

The manager adds two things to ``tf.train.Checkpoint.write``:

* numbering and retention (``max_to_keep``), as ``tf.train.CheckpointManager``
  does, with TensorFlow's ``checkpoint`` state file, so that
  ``tf.train.latest_checkpoint(directory)`` finds the newest one;
* atomic saves: a checkpoint is written into a temporary folder and renamed
  into place only when complete, and only then is it recorded as the
  newest. A save interrupted halfway (a crash, a full disk) leaves the
  previous checkpoint as the newest; the partial folder is never restored
  and is removed by the next save.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from typing import Any, List, Optional

import tensorflow as tf

__all__ = ["CheckpointManager"]

_TMP_PREFIX = ".partial-"


class CheckpointManager:
    """Saves and restores a `tf.train.Checkpoint` in numbered checkpoints.

    Checkpoint ``n`` is the folder ``{directory}/{checkpoint_name}-{n}``; its
    files have the prefix ``{directory}/{checkpoint_name}-{n}/{checkpoint_name}``.

    Example::

        ckpt = tf.train.Checkpoint(model=model, optimizer=optimizer)
        manager = smp.CheckpointManager(ckpt, "/tmp/run", max_to_keep=3)
        manager.restore()        # the newest checkpoint, if there is one
        ...
        manager.save()

    Args:
        checkpoint: the `tf.train.Checkpoint` to save and restore.
        directory: the folder of the checkpoints (created if missing).
        max_to_keep: how many of the newest checkpoints to keep; None keeps all.
        checkpoint_name: the name of every checkpoint (letters, digits, ``_``,
            ``.`` and ``-``).

    Raises:
        ValueError: an argument has the wrong type or value.
    """

    def __init__(
        self,
        checkpoint: Any,
        directory: str,
        max_to_keep: Optional[int] = None,
        checkpoint_name: str = "ckpt",
    ) -> None:
        if not hasattr(checkpoint, "write") or not hasattr(checkpoint, "read"):
            raise ValueError(
                f"CheckpointManager expects a tf.train.Checkpoint. Received: checkpoint={checkpoint!r}"
            )
        if not isinstance(directory, (str, os.PathLike)) or not str(directory):
            raise ValueError(f"CheckpointManager expects a directory path. Received: directory={directory!r}")
        if max_to_keep is not None and (isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1):
            raise ValueError(f"max_to_keep must be None or an int >= 1. Received: max_to_keep={max_to_keep!r}")
        if not isinstance(checkpoint_name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", checkpoint_name):
            raise ValueError(
                "checkpoint_name must be a non-empty name of letters, digits, '_', '.' and '-'. "
                f"Received: checkpoint_name={checkpoint_name!r}"
            )
        self.checkpoint = checkpoint
        self.directory = os.fspath(directory)
        self.max_to_keep = max_to_keep
        self.checkpoint_name = checkpoint_name
        os.makedirs(self.directory, exist_ok=True)

    # -- what is on disk ---------------------------------------------------------
    def _folder(self, number: int) -> str:
        return os.path.join(self.directory, f"{self.checkpoint_name}-{number}")

    def _prefix(self, number: int) -> str:
        return os.path.join(self._folder(number), self.checkpoint_name)

    def _numbers(self) -> List[int]:
        pattern = re.compile(re.escape(self.checkpoint_name) + r"-(\d+)$")
        numbers = []
        for entry in os.listdir(self.directory):
            m = pattern.match(entry)
            if m and os.path.isdir(os.path.join(self.directory, entry)):
                numbers.append(int(m.group(1)))
        return sorted(numbers)

    @property
    def checkpoints(self) -> List[str]:
        """The prefixes of the complete checkpoints, oldest first."""
        return [self._prefix(n) for n in self._numbers()]

    @property
    def latest_checkpoint(self) -> Optional[str]:
        """The prefix of the newest complete checkpoint, or None."""
        numbers = self._numbers()
        return self._prefix(numbers[-1]) if numbers else None

    # -- saving and restoring ----------------------------------------------------
    def save(self, checkpoint_number: Optional[int] = None) -> str:
        """Writes a new checkpoint and records it as the newest.

        Args:
            checkpoint_number: its number; default: one more than the newest.

        Returns:
            The prefix of the checkpoint written (pass it to `restore`).
        """
        numbers = self._numbers()
        number = (numbers[-1] + 1 if numbers else 1) if checkpoint_number is None else int(checkpoint_number)
        for entry in os.listdir(self.directory):
            if entry.startswith(_TMP_PREFIX):  # left by an interrupted save
                shutil.rmtree(os.path.join(self.directory, entry), ignore_errors=True)
        tmp = os.path.join(self.directory, f"{_TMP_PREFIX}{self.checkpoint_name}-{number}-{uuid.uuid4().hex}")
        os.makedirs(tmp)
        # Written eagerly, whatever graph the caller is tracing.
        with tf.init_scope():
            self.checkpoint.write(os.path.join(tmp, self.checkpoint_name), options=_io_options())
        folder = self._folder(number)
        if os.path.exists(folder):
            shutil.rmtree(folder)
        os.replace(tmp, folder)  # atomic: the checkpoint appears complete or not at all
        kept = self._numbers()
        if self.max_to_keep is not None:
            for old in kept[: max(0, len(kept) - self.max_to_keep)]:
                shutil.rmtree(self._folder(old), ignore_errors=True)
            kept = kept[-self.max_to_keep:]
        from tensorflow.python.checkpoint import checkpoint_management

        checkpoint_management.update_checkpoint_state_internal(
            self.directory,
            model_checkpoint_path=self._prefix(number),
            all_model_checkpoint_paths=[self._prefix(n) for n in kept],
            save_relative_paths=True,
        )
        return self._prefix(number)

    def restore(self, path: Optional[str] = None) -> Any:
        """Restores a checkpoint (default: the newest complete one).

        Restoring before the first step works: the values go into the
        variables, which then move to their partitions with them.

        Args:
            path: a prefix returned by `save` (or from `checkpoints`).

        Returns:
            The status of `tf.train.Checkpoint.read` (``assert_consumed()`` and
            friends), or None if there is no checkpoint to restore.

        Raises:
            ValueError: `path` names no complete checkpoint.
        """
        if path is None:
            path = self.latest_checkpoint
            if path is None:
                return None
        elif not tf.io.gfile.exists(os.fspath(path) + ".index"):
            raise ValueError(f"No complete checkpoint at {path!r}. Complete checkpoints: {self.checkpoints}")
        with tf.init_scope():
            return self.checkpoint.read(path, options=_io_options())


def _io_options() -> Optional[tf.train.CheckpointOptions]:
    """When the pipeline spans processes, its driver reads and writes every
    file itself (the variables of other hosts travel to it), so that a
    checkpoint is one set of files on the driver's file system."""
    from smp_tf.distributed import remote

    device = remote.io_device()
    return None if device is None else tf.train.CheckpointOptions(experimental_io_device=device)
