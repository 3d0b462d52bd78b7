from mrtpo.tasks.custom.task import CustomTask

__all__ = ["CustomTask"]
