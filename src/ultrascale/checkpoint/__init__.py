"""Checkpoints that a crash can never half-write: written to a temporary folder, then renamed."""

from ultrascale.checkpoint.store import (CheckpointMeta, find_latest, load_checkpoint,  # noqa: F401
                                         save_checkpoint)
