"""Text-to-SQL task (Spider family, BIRD) with a sandboxed SQLite executor."""

from .task import Text2SQLTask

__all__ = ["Text2SQLTask"]
