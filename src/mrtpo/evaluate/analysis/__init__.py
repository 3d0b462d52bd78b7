"""Comparing training runs: statistics over seeds (``stats``), run folders read back
(``runs``, ``jobs``), per-job records and sweep summaries (``recorder``, ``summary``), and
``src/report.py`` (``report``). ``stats`` and ``runs`` import nothing heavy; the harnesses on
them are ``scripts/replication`` and ``scripts/benchmarks``.
"""
