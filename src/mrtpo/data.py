"""``python -m mrtpo.data fetch ...``: the data command (``mrtpo.fetch``), kept at this short name.

It imports neither torch nor Lightning, so it starts at once. The DataModule that streams a
task's prompts is ``mrtpo.lightning.data``.
"""

if __name__ == "__main__":
    from mrtpo.fetch.cli import main

    raise SystemExit(main())
