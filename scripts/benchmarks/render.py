"""Render docs/benchmarks.md from the sections' JSON (every number in it comes from there):
the tables are built in ``render_tables``, the text around them is the Jinja2 templates in
``templates/`` (``benchmarks.md.j2`` and one file per section)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import jinja2

from benchmarks import render_tables as tables
from benchmarks.render_fmt import (
    BOUND_CONSTANT,
    _case_title,
    _f,
    _headline_case,
    _on_cpu,
    _pct,
    _x,
    _x3,
)

SECTIONS = ("replay", "kernel", "trl", "scaling", "rollout", "schedules")


def _oneline(text: str) -> str:
    """A paragraph wrapped in the template, as the one line Markdown gets."""
    return " ".join(line.strip() for line in text.strip().splitlines()) + "\n"


_ENV = jinja2.Environment(
    loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
    keep_trailing_newline=True,
    autoescape=False,  # Markdown, not HTML
)
_ENV.filters.update(oneline=_oneline, f=_f, x=_x, x3=_x3, pct=_pct, num=format)
_ENV.globals.update(case_title=_case_title, on_cpu=_on_cpu, nan=math.nan, bound=BOUND_CONSTANT)


def render(data: dict[str, dict[str, Any] | None]) -> str:
    rep, kern, trl, scal, roll, sched = (data.get(k) for k in SECTIONS)
    present = [d for d in (rep, kern, trl, scal, roll, sched) if d]
    ctx: dict[str, Any] = dict(
        present=present, rep=rep, kern=kern, trl=trl, scal=scal, roll=roll, sched=sched
    )
    if present:
        ctx.update(targets=tables.targets_table(rep, kern, trl, scal), head=_headline_case(rep))
    if rep:
        ctx["replay_cases"] = [tables.replay_case(c, _on_cpu(rep)) for c in rep["cases"]]
    if kern:
        ctx["kernel_table"] = tables.kernel_table(kern)
    if trl:
        ctx["trl_table"] = tables.trl_table(trl)
    if scal:
        ctx["scaling_tables"] = tables.scaling_tables(scal)
    if roll:
        ctx["rollout_table"] = tables.rollout_table(roll)
    if sched:
        ctx["schedule_targets"], ctx["schedule_table"] = tables.schedule_tables(sched)
    return _ENV.get_template("benchmarks.md.j2").render(ctx)
