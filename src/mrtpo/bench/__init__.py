"""Benchmarks and GPU checks, importable so that tests keep them working.

* ``harness`` — ``make bench``: the four sections and the plans (``QUICK``, ``FULL``);
* ``steps`` — MRTPO against GDPO on one fixed rollout (sections 1 and 4);
* ``kernel`` — the JSD kernel's speed and peak memory, one process per configuration;
* ``against_trl`` — our GDPO step against TRL's ``GRPOTrainer`` (section 3);
* ``render`` — ``docs/benchmarks.md`` from the sections' JSON;
* ``gpu`` — the GPU check of the trainer itself (``scripts/gpu_check.py``; runs without
  Hydra), with ``gpu_vllm`` as its vLLM stage.

Nothing here is imported by training.
"""
