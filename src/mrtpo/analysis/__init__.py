"""Analysis of training runs: statistics over seeds, reading run outputs, the job runner and
the toy-replication harness behind ``make replicate``.

    stats        t quantiles and intervals, paired differences, learning-curve summaries, trend in K
    runs         reading metrics.csv and the JSON-lines dumps of a run folder
    jobs         composed configs trained in a pool of worker processes
    relevance    where each reward's relevance lands (the checker's tokens or elsewhere)
    plots        learning curves and relevance pictures
    replication  the harness: warm starts, RL jobs, analysis, report
    sweep        per-job records, a multirun's summary.csv/.md, and src/report.py's tables

``stats`` and ``runs`` import nothing heavy, so any comparison of runs can use them.
"""
