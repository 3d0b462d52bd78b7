"""Comparing training runs: statistics over seeds, reading run outputs, sweep summaries.

    stats        t quantiles and intervals, paired differences, learning-curve summaries, trend in K
    runs         reading metrics.csv and the JSON-lines dumps of a run folder
    sweep        per-job records (a Hydra callback), a multirun's summary.csv/.md, and
                 src/report.py's tables

``stats`` and ``runs`` import nothing heavy, so any comparison of runs can use them. The
harnesses built on them live outside the library, beside the scripts that run them:
``scripts/replication`` (``make replicate``) and ``scripts/benchmarks`` (``make bench``).
"""
