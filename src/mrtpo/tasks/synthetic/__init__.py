from mrtpo.tasks.synthetic.task import SyntheticTask

__all__ = ["SyntheticTask"]
