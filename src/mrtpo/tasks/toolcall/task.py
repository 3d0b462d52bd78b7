"""``task=toolcall``: ToolRL-style tool calling, trained on RLLA, evaluated on BFCL v4.

Rewards ``format`` (0/1) and ``correctness`` (-3..3) and their verifier blocks in
``rewards.py``. Splits: any key of ``data_files`` (RLLA files), ``bfcl`` (the ten single-turn
AST categories, or ``eval.categories``) and each BFCL category name on its own.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from mrtpo.tasks.base import Example, Score, Task, tag_spans
from mrtpo.tasks.toolcall import bfcl
from mrtpo.tasks.toolcall.parsing import clean_response, coerce_calls, load_rlla
from mrtpo.tasks.toolcall.rewards import (
    CORRECTNESS_MAX,
    CORRECTNESS_MIN,
    correctness_block,
    correctness_reward,
    format_block,
    format_reward,
)

log = logging.getLogger(__name__)

_BFCL_CORRECTNESS_REASON = "BFCL cases are judged by BFCL's AST checker (see check/bfcl_valid)"


class ToolCallTask(Task):
    """Tool calling with ToolRL's rewards on RLLA data; BFCL's checker for evaluation."""

    name = "toolcall"
    reward_names = ("format", "correctness")
    block_order = ("correctness", "format")
    # SAW computes correctness's CV on values shifted by +3, as the official SAW code does.
    reward_ranges = {"correctness": (CORRECTNESS_MIN, CORRECTNESS_MAX)}

    def __init__(
        self,
        data_files: Mapping[str, str] | None = None,
        limits: Mapping[str, int | None] | None = None,
        bfcl_categories: Sequence[str] | str | None = None,
    ) -> None:
        """``data_files``: split -> RLLA file (.json/.jsonl/.parquet, RL or SFT layout);
        ``limits``: split -> first N examples; ``bfcl_categories``: the ``bfcl`` split's
        default categories (all ten when unset)."""
        self.data_files = dict(data_files or {})
        self.limits = dict(limits or {})
        self.bfcl_categories = bfcl.check_categories(bfcl_categories)
        self._cache: dict[str, list[Example]] = {}

    # ---- data -----------------------------------------------------------------------------
    def examples(self, split: str) -> Sequence[Example]:
        if split == "bfcl":
            return self._bfcl(self.bfcl_categories)
        if split in bfcl.CATEGORIES:
            return self._bfcl([split])
        if split not in self.data_files or not self.data_files[split]:
            raise KeyError(
                f"toolcall has no data file for split {split!r}: set task.data_files.{split} "
                f"(configured: {sorted(self.data_files)}), or use eval.split=bfcl"
            )
        if split not in self._cache:
            self._cache[split] = load_rlla(self.data_files[split], limit=self.limits.get(split))
        return self._cache[split]

    def eval_examples(self, split: str, options: dict[str, Any]) -> Sequence[Example]:
        """``bfcl`` reads ``options["categories"]`` (BFCL names; empty: the task default)."""
        if split == "bfcl":
            cats = options.get("categories") if options else None
            return self._bfcl(bfcl.check_categories(cats) if cats else self.bfcl_categories)
        return self.examples(split)

    def _bfcl(self, categories: Sequence[str]) -> list[Example]:
        key = "bfcl:" + ",".join(categories)
        if key not in self._cache:
            self._cache[key] = bfcl.load_cases(categories)
        return self._cache[key]

    # ---- rewards ----------------------------------------------------------------------------
    def score(self, example: Example, response: str) -> Score:
        text = clean_response(response)
        d = example.data
        fmt, why_fmt = format_reward(text, d["tags"])
        reasons = {"format": why_fmt} if why_fmt else {}
        if d.get("source") == "bfcl":
            verdict = bfcl.check_response(example, text)
            if not verdict["valid"]:
                reasons["bfcl"] = _short(verdict.get("error"))
            reasons["correctness"] = _BFCL_CORRECTNESS_REASON
            return Score(
                rewards={"format": fmt, "correctness": None},
                reasons=reasons,
                checks={
                    "bfcl_valid": verdict["valid"],
                    "category": d["category"],
                    "bfcl_error_type": verdict.get("error_type"),
                },
            )

        gold = d["reference_calls"]
        corr, why_corr = correctness_reward(gold, text, d["tools"])
        if why_corr:
            reasons["correctness"] = why_corr
        typed = None if gold is None else coerce_calls(gold, d["tools"])
        blocks = {"correctness": correctness_block(typed), "format": format_block(d["tags"])}
        checks: dict[str, Any] = {"reference_calls": gold is not None}
        if gold is not None:
            checks["exact_match"] = corr == CORRECTNESS_MAX
        rewards = {"format": fmt, "correctness": corr}
        return Score(rewards=rewards, blocks=blocks, reasons=reasons, checks=checks)

    # ---- evaluation ---------------------------------------------------------------------------
    def segments(self, response: str) -> dict[str, list[tuple[int, int]]]:
        """The reasoning (``think``) and the first call block (``tool_call``), tags included."""
        return tag_spans(response, ("think", "tool_call"))

    def summarize(self, examples: Sequence[Example], scores: Sequence[Score]) -> dict[str, float]:
        """Reward means; for RLLA the exact-match rate; for BFCL per-category accuracy and
        BFCL's summary averages (``bfcl/...``)."""
        out = super().summarize(examples, scores)
        by_cat: dict[str, list[bool]] = defaultdict(list)
        exact: list[bool] = []
        for s in scores:
            if "bfcl_valid" in s.checks:
                by_cat[s.checks["category"]].append(bool(s.checks["bfcl_valid"]))
            elif "exact_match" in s.checks:
                exact.append(bool(s.checks["exact_match"]))
        fmt = [v for s in scores if (v := s.rewards.get("format")) is not None]
        if fmt:
            out["format_accuracy"] = sum(v == 1.0 for v in fmt) / len(fmt)
        if exact:
            out["exact_match"] = sum(exact) / len(exact)
        if by_cat:
            out.update(bfcl.summarize(by_cat))
        return out


def _short(error: Any, limit: int = 300) -> str:
    text = str(error[0]) if isinstance(error, list) and error else str(error)
    return text if len(text) <= limit else text[: limit - 3] + "..."
