"""Training: prepare (text -> .bin), data, schedule, the settings, the trainer state, memory, DDP, the loop."""

from .args import TrainArgs
from .loop import Callbacks, NonFiniteError, Trainer, TrainResult
from .setup import prepare_model

__all__ = ["Callbacks", "NonFiniteError", "TrainArgs", "TrainResult", "Trainer", "prepare_model"]
