"""Instruction following (IFEval-style constraints): see ``task.py``."""

from mrtpo.tasks.instructions.task import InstructionTask

__all__ = ["InstructionTask"]
