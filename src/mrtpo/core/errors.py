"""The project's one-line errors: a bad setting or a failed job that Hydra reports by its message.

A ``CompactHydraException`` raised in a job makes Hydra print its message alone (under the
line naming the job's overrides) rather than a traceback, and still record the job as failed.
Every wing raises these, so they live at the bottom.
"""

from __future__ import annotations

try:  # the bare GPU runner imports this module on a machine without Hydra
    from hydra.errors import CompactHydraException
except ImportError:  # pragma: no cover - exercised by the GPU runner's dry run

    class CompactHydraException(Exception):  # type: ignore[no-redef]
        """Stands in for Hydra's where Hydra is not installed."""


class ConfigError(ValueError, CompactHydraException):
    """A config value that cannot work; the message names the key and what is allowed."""
