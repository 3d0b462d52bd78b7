"""Tool calling (ToolRL rewards, RLLA data, BFCL v4 AST evaluation). See ``task.py``."""

from mrtpo.tasks.toolcall.task import ToolCallTask

__all__ = ["ToolCallTask"]
