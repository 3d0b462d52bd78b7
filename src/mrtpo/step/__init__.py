"""The RL step without a training framework: ``RLStep`` and the records it passes along."""

from mrtpo.step.records import Advantages, OldPolicy, Relevance, StepRecord, StepResult, Update
from mrtpo.step.step import MINIBATCH_STREAM, SHUFFLE_STREAM, RLStep
from mrtpo.step.update import TorchHost, UpdateHost

__all__ = [
    "MINIBATCH_STREAM",
    "SHUFFLE_STREAM",
    "Advantages",
    "OldPolicy",
    "RLStep",
    "Relevance",
    "StepRecord",
    "StepResult",
    "TorchHost",
    "Update",
    "UpdateHost",
]
