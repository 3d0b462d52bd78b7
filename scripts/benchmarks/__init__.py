"""Benchmarks and the GPU check, beside the scripts that run them (``scripts/bench.py``,
``scripts/gpu_check.py``); not part of the installed ``mrtpo`` package, and nothing in
training imports them. Tests reach them through pytest's ``pythonpath``.

* ``harness`` — ``make bench``: the sections and the plans (``QUICK``, ``FULL``); a new
  section is a plan entry in both, a ``section_<name>`` function there (listed in
  ``SECTIONS`` and ``run_section``), and its part of the document: a template in
  ``templates/`` included from ``benchmarks.md.j2``, its tables in ``render_tables``;
* ``common`` — model sizes, the composed configs and methods, controlled rewards, JSON out;
* ``steps`` — MRTPO against GDPO on one fixed rollout (sections 1 and 4);
* ``kernel`` — the JSD kernel's speed and peak memory, one process per configuration;
* ``against_trl`` — our GDPO step against TRL's ``GRPOTrainer`` (section 3);
* ``render`` — ``docs/benchmarks.md`` from the sections' JSON: the text is the Jinja2
  templates in ``templates/`` (the page, one file per section), the tables come from
  ``render_tables``, the number formats from ``render_fmt``;
* ``gpu`` — the GPU check of the trainer itself (``scripts/gpu_check.py``; runs without
  Hydra): its sizes and report in ``gpu_setup``, the trainer built by hand in ``gpu_trainer``,
  and ``gpu_vllm`` (with ``gpu_vllm_model``) as its vLLM stage.
"""
