"""Comparing training runs: statistics over seeds, reading run outputs, sweep summaries.

    stats        t quantiles and intervals, paired differences, learning-curve summaries, trend in K
    runs         reading metrics.csv and the JSON-lines dumps of a run folder
    jobs         a sweep's run folders read back (job.json, .hydra/) and grouped by overrides
    recorder     per-job records and the multirun's summary (a Hydra callback)
    summary      a sweep's summary.csv/.md, and the formatting the reports share
    report       src/report.py: groups compared over seeds, paired differences, curves

``stats`` and ``runs`` import nothing heavy; the harnesses on them are ``scripts/replication``
and ``scripts/benchmarks``.
"""
