"""The toy replication behind ``make replicate`` (``scripts/replicate.py``), beside the script
that runs it; not part of the installed ``mrtpo`` package.

    harness      warm starts, RL jobs, the analysis and ``docs/replication.md``
    claims       one verdict per claim of the paper, by the rules the report states
    jobs         composed configs trained in a pool of worker processes
    relevance    where each reward's relevance lands (the checker's tokens or elsewhere)
    plots        learning curves and relevance pictures
    long         the long toy (``--long``): a free part before the answer, a rare ``mark``
    long_report  its predictions, verdicts, diagnostics and ``docs/replication_long.md``;
                 its ``main`` runs the long toy, then writes the report

The statistics and run readers it uses are the library's (``mrtpo.evaluate.analysis``).
"""
