"""Text-to-SQL task (Spider family, BIRD) with a sandboxed SQLite executor."""

from .executor import ExecJob, ExecOutcome, Limits, SQLExecutor
from .match import result_eq, results_match
from .task import Text2SQLTask

__all__ = [
    "ExecJob",
    "ExecOutcome",
    "Limits",
    "SQLExecutor",
    "Text2SQLTask",
    "result_eq",
    "results_match",
]
