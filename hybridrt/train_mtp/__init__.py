"""Training MTP heads by self-distillation (`hybridrt train-mtp`); see train.py."""
from .train import TrainConfig, TrainResult, train_mtp

__all__ = ["TrainConfig", "TrainResult", "train_mtp"]
