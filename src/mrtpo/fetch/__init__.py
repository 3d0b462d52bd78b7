"""The data command (``python -m mrtpo.data fetch``): the public data sets, checked and laid out
as the task configs read them. See :mod:`mrtpo.fetch.cli`."""
