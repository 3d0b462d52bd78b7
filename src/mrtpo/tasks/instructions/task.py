"""Instruction following: one binary reward per constraint, checked by the benchmarks' code.

Reward slots are positional (``c0 .. c{max_constraints-1}``, shown as ``constraint {k+1}``),
a prompt's unused ones ``None``: the reward set varies per prompt, which SAW refuses.
``success`` is ``prompt_strict``. ``P_all`` is the sampling prompt, ``P_\\k`` the same
template without constraint ``k`` (no verifier blocks). Splits: ``train`` (HIR-16K at
``task.data.path``, else ``generated``), ``val`` (``task.val_split``), ``ifeval``, ``ifbench``,
``muldimif``, ``advancedif``, ``hir``; they, the length cap and the per-call time budget are
described in docs/tasks/instructions.md.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from mrtpo.tasks.base import Contexts, Example, Messages, Score, Task, last_user_index
from mrtpo.tasks.deadline import budget_seconds
from mrtpo.tasks.instructions import checkers, muldimif
from mrtpo.tasks.instructions.data import (
    HIR_SUBSETS,
    TRAINABLE_SUBSETS,
    Constraint,
    Record,
    load_benchmark,
    load_hir,
    render_prompt,
    sentence_spans,
)
from mrtpo.tasks.instructions.generator import generate_records
from mrtpo.tasks.instructions.judge import (
    JudgeError,
    RubricJudge,
    judge_from_options,
    load_advancedif,
)

log = logging.getLogger(__name__)

DEFAULT_EVAL_FILES = {
    "ifeval": "../shared/data/ifeval/input_data.jsonl",
    "ifbench": "../shared/data/ifbench/IFBench_test.jsonl",
    "advancedif": "../shared/data/advancedif/if_oss_full_data.csv",
    "muldimif": "../shared/data/muldimif/test.json",
}
DEFAULT_MULDIMIF_DIR = "../shared/vendor/muldimif"
DATA_DEFAULTS = {"path": None, "subsets": ["ifeval", "ifbench"], "template": "type6"}
GENERATOR_DEFAULTS = {"num_prompts": 2048, "seed": 0, "min_constraints": 5, "max_constraints": 13}


class InstructionTask(Task):
    name = "ifeval"
    rewards_vary_per_prompt = True
    info_in_prompt = True  # the constraints are sentences of the prompt
    success_check = "prompt_strict"  # every constraint of the prompt met (train/success)

    def __init__(
        self,
        max_constraints: int = 13,
        data: Mapping[str, Any] | None = None,
        generator: Mapping[str, Any] | None = None,
        eval_files: Mapping[str, str] | None = None,
        val_split: str = "ifeval",
        nltk_data_dir: str = ".cache/nltk_data",
        unavailable_checkers: str = "error",
        loose_in_training: bool = False,
        judge: Mapping[str, Any] | None = None,
        muldimif: Mapping[str, Any] | None = None,
        max_response_chars: int | None = 16384,
        checker_timeout_s: float | None = 2.0,
    ) -> None:
        if max_constraints < 1:
            raise ValueError("task.max_constraints must be >= 1")
        if unavailable_checkers not in ("error", "skip"):
            raise ValueError("task.unavailable_checkers must be 'error' or 'skip'")
        self.max_constraints = int(max_constraints)
        self.reward_names = tuple(f"c{i}" for i in range(self.max_constraints))
        self.data_cfg = {**DATA_DEFAULTS, "checkers": "hir", **dict(data or {})}
        if self.data_cfg["checkers"] not in checkers.CHECKER_VARIANTS:
            raise ValueError(
                f"task.data.checkers must be one of {list(checkers.CHECKER_VARIANTS)}, "
                f"got {self.data_cfg['checkers']!r}"
            )
        if max_response_chars is not None and int(max_response_chars) < 1:
            raise ValueError("task.max_response_chars must be >= 1 (or null for no cap)")
        self.max_response_chars = None if max_response_chars is None else int(max_response_chars)
        self.checker_timeout_s = budget_seconds(checker_timeout_s, "task.checker_timeout_s")
        self.n_timeouts = 0  # checker calls that ran past the budget (logged once)
        self.muldimif_cfg = {"checker_dir": DEFAULT_MULDIMIF_DIR, **dict(muldimif or {})}
        self.n_over_length = 0  # responses refused by the length cap (logged once)
        self.gen_cfg = {**GENERATOR_DEFAULTS, **dict(generator or {})}
        if int(self.gen_cfg["max_constraints"]) > self.max_constraints:  # it may not draw more
            raise ValueError(
                f"task.generator.max_constraints ({self.gen_cfg['max_constraints']}) exceeds "
                f"task.max_constraints ({self.max_constraints})"
            )
        self.eval_files = {**DEFAULT_EVAL_FILES, **dict(eval_files or {})}
        self.val_split = val_split
        self.nltk_data_dir = str(nltk_data_dir)
        self.unavailable_checkers = unavailable_checkers
        self.loose_in_training = bool(loose_in_training)
        self.judge_cfg = dict(judge or {})
        self._judge: RubricJudge | None = None
        self._cache: dict[str, list[Example]] = {}  # split -> the prompts examples() gives
        self._loaded: dict[str, list[Example]] = {}  # split -> all its prompts
        self.skipped: dict[str, int] = {}  # split -> prompts left out (unavailable checkers)

    @property
    def reward_labels(self) -> dict[str, str]:
        """Slot ``c{k}`` is the (k+1)-th constraint of each prompt, whatever that one asks."""
        return {name: f"constraint {k + 1}" for k, name in enumerate(self.reward_names)}

    # ---- data ---------------------------------------------------------------------------
    def examples(self, split: str) -> Sequence[Example]:
        """The split's prompts whose checkers all run here; a prompt whose checker cannot run
        fails the whole split (training and validation use all of it), or with
        ``task.unavailable_checkers=skip`` is left out."""
        if split == "val":
            if self.val_split in ("val", "train"):
                raise ValueError("task.val_split must name an evaluation split (e.g. ifeval)")
            return self.examples(self.val_split)
        if split not in self._cache:
            self._cache[split] = self._drop_unavailable(split, self._every(split))
        return self._cache[split]

    def _every(self, split: str) -> list[Example]:
        """Every prompt of the split, whether its checkers can run here or not."""
        if split not in self._loaded:
            self._loaded[split] = self._load(split)
        return self._loaded[split]

    def eval_examples(self, split: str, options: Mapping[str, Any]) -> Sequence[Example]:
        """The prompts ``src/eval.py`` may score. Only the prompts actually evaluated must have
        working checkers (``check_scorable``): the first ``eval.limit`` when generating, the
        ones a responses file answers when scoring it."""
        if split == "advancedif":
            self._judge = judge_from_options(options, self.judge_cfg)
        if split == "val" or self.unavailable_checkers == "skip":
            return self.examples(split)
        every = self._every(split)
        if not options.get("responses"):  # generate mode: fail before any model loads
            limit = options.get("limit")
            self.check_scorable(every[: int(limit)] if limit else every)
        return every

    def check_scorable(self, examples: Sequence[Example]) -> None:
        """Refuse, naming them, evaluated prompts whose checkers cannot run on this machine
        (their NLTK data is missing): never a silent 0."""
        unique = list({e.id: e for e in examples}.values())
        hit, why = self._unavailable(unique)
        if hit:
            raise checkers.CheckerUnavailable(
                f"{len(hit)} of the {len(unique)} prompts evaluated (ids {hit[:5]}"
                f"{' ...' if len(hit) > 5 else ''}) {why}. Or leave those prompts out of the "
                "evaluation, or set task.unavailable_checkers=skip (reported as n_prompts_skipped)"
            )

    def _load(self, split: str) -> list[Example]:
        if split == "train":
            return self._load("hir" if self.data_cfg.get("path") else "generated")
        if split == "generated":  # drawn by the constraint generator (task.generator)
            g = self.gen_cfg
            kw = {k: int(g[k]) for k in ("seed", "min_constraints", "max_constraints")}
            recs = generate_records(self._registry("ifeval"), int(g["num_prompts"]), **kw)
            return self._examples("generated", recs, is_eval=False)
        if split == "hir":
            return self._load_hir()
        if split in ("ifeval", "ifbench"):
            recs = load_benchmark(self._eval_file(split), split)
            reg = self._registry(split)
            unknown = dict(Counter(c.id for r in recs for c in r.constraints if c.id not in reg))
            if unknown:
                raise ValueError(f"{split}: instruction ids unknown to its checkers: {unknown}")
            return self._examples(split, recs, is_eval=True)
        if split == "advancedif":
            return self._examples(split, load_advancedif(self._eval_file(split)), is_eval=True)
        if split == "muldimif":
            return self._muldimif_examples()
        raise ValueError(
            f"unknown split {split!r} for task ifeval: use train, val, generated, hir, ifeval, "
            "ifbench, muldimif or advancedif"
        )

    def _load_hir(self) -> list[Example]:
        """HIR-16K prompts from task.data.path, of the subsets the checkers score."""
        path = self.data_cfg.get("path")
        if not path:
            raise ValueError("split 'hir' needs task.data.path (a HIR-16K parquet/jsonl file)")
        subsets = list(self.data_cfg.get("subsets") or [])
        bad = [s for s in subsets if HIR_SUBSETS.get(s, s) not in TRAINABLE_SUBSETS]
        if bad or not subsets:
            raise ValueError(
                f"task.data.subsets={subsets}: only the subsets the installed checkers "
                f"score can be trained on: {list(TRAINABLE_SUBSETS)} (or type1, type2)"
            )
        if not Path(path).is_file():
            raise FileNotFoundError(f"HIR-16K file not found: {path} (task.data.path)")
        recs, skipped = load_hir(path, subsets, str(self.data_cfg["template"]))
        recs = self._known_and_fitting(recs, skipped)
        kept = {"prompts": len(recs), "constraints": sum(len(r.constraints) for r in recs)}
        self.hir_counts = {**kept, **{f"skipped/{k}": v for k, v in skipped.items()}}
        log.info("HIR-16K %s: kept %s; skipped %s", path, kept, dict(skipped))
        if not recs:
            raise ValueError(f"no usable HIR-16K prompts in {path} (skipped: {dict(skipped)})")
        return self._examples("hir", recs, is_eval=False)

    def _muldimif(self) -> Any:
        return muldimif.load_harness(str(self.muldimif_cfg["checker_dir"]), self.nltk_data_dir)

    def _muldimif_examples(self) -> list[Example]:
        harness = self._muldimif()  # fail before reading data when the checkers are missing
        items = muldimif.load_test(self._eval_file("muldimif"))
        keys = Counter(f"{c[0]}_{c[1]}" for it in items for c in it["constraints"])
        unknown = {k: n for k, n in keys.items() if k not in harness.class_mapping}
        if unknown:
            raise ValueError(f"muldimif: constraint keys without a checker: {unknown}")
        recs = []
        for it in items:
            messages = [{"role": m["role"], "content": m["content"]} for m in it["conversations"]]
            cons = [Constraint(f"{c[0]}_{c[1]}", {}, c[2]) for c in it["constraints"]]
            uid, prompt, meta = str(it["id"]), messages[-1]["content"], {"messages": messages}
            recs.append(
                Record(uid, prompt, cons, "muldimif", source="muldimif", template=None, meta=meta)
            )
        out = self._examples("muldimif", recs, is_eval=True)
        for e, it in zip(out, items):  # what the official metrics group by, and read
            e.data["constraint_pattern"] = it.get("constraint_pattern", "unknown")
            e.data["difficulty"] = it.get("difficulty", "unknown")
            for c, triple in zip(e.data["constraints"], it["constraints"]):
                c["triple"] = list(triple)
        return out

    def _eval_file(self, split: str) -> str:
        path = self.eval_files.get(split)
        if not path:
            raise ValueError(f"no file for split {split!r}: set task.eval_files.{split}")
        if not Path(path).is_file():
            raise FileNotFoundError(
                f"{split} data not found at {path}: set task.eval_files.{split}"
            )
        return str(path)

    def _registry(self, name: str, variant: str = "official") -> checkers.Registry:
        return checkers.registry(name, self.nltk_data_dir, variant)

    def _known_and_fitting(self, recs: list[Record], skipped: Counter) -> list[Record]:
        keep, unknown = [], Counter()
        variant = str(self.data_cfg["checkers"])
        for r in recs:
            reg = self._registry(r.registry, variant)
            missing = [c.id for c in r.constraints if c.id not in reg]
            if len(r.constraints) > self.max_constraints:
                skipped[f"more than task.max_constraints={self.max_constraints}"] += 1
            elif missing:
                skipped[f"instruction id unknown to the {r.registry} checkers"] += 1
                unknown.update(f"{r.registry}/{m}" for m in missing)
            elif not self._buildable(reg, r):
                # e.g. language "zh", which only HiR's language table has (task.data.checkers)
                skipped[f"the {variant} {r.registry} checker rejects its arguments"] += 1
            else:
                keep.append(r)
        if unknown:
            log.warning(
                "HIR-16K: %d prompts use instructions no installed checker knows (most common: "
                "%s); they are left out",
                sum(v for k, v in skipped.items() if "unknown" in k),
                dict(unknown.most_common(10)),
            )
        return keep

    @staticmethod
    def _buildable(reg: checkers.Registry, rec: Record) -> bool:
        try:
            for c in rec.constraints:
                reg.build(c.id, c.kwargs, rec.prompt)
        except (KeyError, ValueError, TypeError):
            return False
        return True

    def _examples(self, split: str, recs: list[Record], is_eval: bool) -> list[Example]:
        out = []
        for r in recs:
            messages = r.meta.get("messages") or [{"role": "user", "content": r.prompt}]
            data = {
                "split": split,
                "source": r.source,
                "registry": r.registry,
                "base": r.base,
                "template": r.template,
                "prompt": r.prompt,
                "constraints": [
                    {"id": c.id, "kwargs": dict(c.kwargs), "text": c.text} for c in r.constraints
                ],
                "eval": is_eval,
                # HiR's checker variants score HIR-16K prompts only; benchmarks stay official
                "checkers": self.data_cfg["checkers"] if r.source == "hir" else "official",
            }
            out.append(Example(id=r.uid, messages=messages, data=data))
        return out

    def _unavailable(self, examples: Sequence[Example]) -> tuple[list[str], str]:
        """The ids of the prompts whose checkers cannot run here, and why (for a message)."""
        cases: dict[tuple[str, str], dict[str, tuple[Any, str]]] = defaultdict(dict)
        for e in examples:
            d = e.data
            if d.get("registry") in ("ifeval", "ifbench"):
                key = (d["registry"], str(d.get("checkers", "official")))
                for c in d["constraints"]:
                    cases[key].setdefault(c["id"], (c["kwargs"], d["prompt"]))
        bad: dict[str, str] = {}
        for (name, variant), reg_cases in cases.items():
            bad.update(checkers.unavailable_instructions(self._registry(name, variant), reg_cases))
        hit = [e.id for e in examples if any(c["id"] in bad for c in e.data["constraints"])]
        first = next(iter(bad.values()), "")
        return hit, f"use instructions whose checkers cannot run here ({sorted(bad)}): {first}"

    def _drop_unavailable(self, split: str, examples: list[Example]) -> list[Example]:
        """Fail (or, if asked, skip those prompts) when a checker cannot run on this machine."""
        hit, why = self._unavailable(examples)
        if not hit:
            return examples
        msg, hit = f"split {split}: {len(hit)} of {len(examples)} prompts {why}", set(hit)
        if self.unavailable_checkers == "error":
            raise checkers.CheckerUnavailable(
                msg + ". Or set task.unavailable_checkers=skip to leave those prompts out "
                "(reported as n_prompts_skipped)"
            )
        log.warning("%s; leaving them out (task.unavailable_checkers=skip)", msg)
        # counted under the split the prompts name (train's are "hir" or "generated")
        self.skipped.update(Counter(e.data.get("split", split) for e in examples if e.id in hit))
        return [e for e in examples if e.id not in hit]

    # ---- rewards ------------------------------------------------------------------------
    def score(self, example: Example, response: str) -> Score:
        d = example.data
        limit = self.max_response_chars
        over = limit is not None and len(response) > limit and d["registry"] != "judge"
        if over:
            judged = self._over_length(example, response, limit)
        elif d["registry"] == "judge":
            judged = self._judge_verdicts(example, response)
        elif d["registry"] == "muldimif":
            triples = [c["triple"] for c in d["constraints"]]
            answer = muldimif.strip_think(response)
            judged = muldimif.verdicts(self._muldimif(), triples, answer, self.checker_timeout_s)
        else:
            judged = self._checker_verdicts(example, response)
        strict, loose = [v.strict for v in judged], [v.loose for v in judged]
        rewards: dict[str, float | None] = dict.fromkeys(self.reward_names)
        for i, ok in enumerate(strict[: self.max_constraints]):
            rewards[f"c{i}"] = 1.0 if ok else 0.0
        result: dict[str, Any] = {
            "instruction_ids": [c["id"] for c in d["constraints"]],
            "strict": strict,
            "prompt_strict": all(strict) and not over,
        }
        if over:
            result["over_length"] = True
        if None not in loose:  # computed (evaluation, task.loose_in_training)
            result["loose"] = loose
            result["prompt_loose"] = all(loose) and not over
        timeouts = sum(v.timed_out for v in judged)
        if timeouts:
            result["timeouts"] = timeouts
            self.n_timeouts += timeouts
            if self.n_timeouts == timeouts:  # the first time in this process
                log.warning(
                    "example %s: %d checker call(s) ran past task.checker_timeout_s=%s s and "
                    "count as failed constraints (the reason is in Score.reasons; evaluation "
                    "reports n_checker_timeouts); further ones are not logged",
                    example.id,
                    timeouts,
                    self.checker_timeout_s,
                )
        reasons = {f"c{i}": v.reason for i, v in enumerate(judged) if v.reason}
        return Score(rewards=rewards, reasons=reasons, checks=result)

    def _checker_verdicts(self, example: Example, response: str) -> list[checkers.Check]:
        """The IFEval / IFBench checkers (strict, and loose when wanted), each call under
        ``task.checker_timeout_s``; a reason names its instruction."""
        d = example.data
        reg = self._registry(d["registry"], d.get("checkers", "official"))
        want_loose, out = bool(d.get("eval")) or self.loose_in_training, []
        for c in d["constraints"]:
            args = (c["id"], c["kwargs"], d["prompt"], response, want_loose)
            res = checkers.check(reg, *args, budget_s=self.checker_timeout_s)
            out.append(replace(res, reason=res.reason and f"{c['id']}: {res.reason}"))
        return out

    def _over_length(self, example: Example, response: str, limit: int) -> list[checkers.Check]:
        """Every constraint fails: the text is longer than the checkers are trusted to run on."""
        self.n_over_length += 1
        if self.n_over_length == 1:
            log.warning(
                "a response of %d characters exceeds task.max_response_chars=%d: every "
                "constraint scores 0 without running the checkers (some upstream checkers take "
                "quadratic time on such text); counted as n_over_length",
                len(response),
                limit,
            )
        why = f"response longer than task.max_response_chars={limit} ({len(response)} chars)"
        d = example.data
        loose = False if d.get("eval") and d["registry"] != "muldimif" else None
        return [checkers.Check(False, loose, why)] * len(d["constraints"])

    def _judge_verdicts(self, example: Example, response: str) -> list[checkers.Check]:
        rubrics = [c["text"] for c in example.data["constraints"]]
        if not response.strip():
            verdicts = [False] * len(rubrics)
        else:
            if self._judge is None:
                raise JudgeError("AdvancedIF needs a judge: set eval.judge_url")
            verdicts = self._judge.verdicts(example.messages, response, rubrics)
        why = [None if ok else f"rubric not met: {r[:80]}" for ok, r in zip(verdicts, rubrics)]
        return [checkers.Check(ok, ok, w) for ok, w in zip(verdicts, why)]

    # ---- replay contexts ----------------------------------------------------------------
    def contexts(self, example: Example, score: Score) -> Contexts:
        """``P_all`` = the prompt; ``P_\\k`` = the template without constraint k's sentence."""
        d = example.data
        messages = [dict(m) for m in example.messages]
        if d.get("base") is None:  # benchmark prose: no sentence to leave out
            return Contexts(all=messages, without={}, none=[dict(m) for m in messages])
        texts = [c["text"] for c in d["constraints"]]

        def prompt(keep: list[str]) -> Messages:
            return [{"role": "user", "content": render_prompt(d["base"], keep, d["template"])}]

        n = min(len(texts), self.max_constraints)
        without = {f"c{k}": prompt(texts[:k] + texts[k + 1 :]) for k in range(n)}
        m = last_user_index(messages)
        found = sentence_spans(messages[m]["content"], d["base"], texts[:n], d["template"])
        spans = {f"c{k}": [(m, *se)] for k, se in enumerate(found) if se is not None}
        none_spans = [(m, *se) for se in found if se is not None]
        return Contexts(messages, without, prompt([]), spans, none_spans)

    # ---- evaluation ---------------------------------------------------------------------
    def summarize(self, examples: Sequence[Example], scores: Sequence[Score]) -> dict[str, float]:
        """Strict / loose accuracy at prompt and instruction level, over every scored line
        (n samples of a prompt count n times, as the benchmarks average them)."""
        rows = [
            (e, s) for e, s in zip(examples, scores) if s.error is None and "strict" in s.checks
        ]
        out: dict[str, float] = {"n_scored": float(len(rows))}
        splits = {e.data.get("split") for e in examples}
        skipped = sum(self.skipped.get(s, 0) for s in splits if s)
        if skipped:
            out["n_prompts_skipped"] = float(skipped)
        if not rows:
            return out
        out["n_prompts"] = float(len({e.id for e, _ in rows}))
        out["constraints_per_prompt"] = sum(len(s.checks["strict"]) for _, s in rows) / len(rows)
        modes = ["strict"] + (["loose"] if all("loose" in s.checks for _, s in rows) else [])
        per_id: dict[str, list[bool]] = defaultdict(list)
        for mode in modes:
            flat = [ok for _, s in rows for ok in s.checks[mode]]
            out[f"prompt_level_{mode}_acc"] = sum(all(s.checks[mode]) for _, s in rows) / len(rows)
            out[f"inst_level_{mode}_acc"] = sum(flat) / max(len(flat), 1)
        for _, s in rows:
            for iid, ok in zip(s.checks["instruction_ids"], s.checks["strict"]):
                if iid != "rubric":
                    per_id[iid].append(ok)
        for iid, oks in sorted(per_id.items()):
            out[f"inst_strict/{iid}"] = sum(oks) / len(oks)
        for key, check in (("n_over_length", "over_length"), ("n_checker_timeouts", "timeouts")):
            n = sum(int(s.checks.get(check, 0)) for _, s in rows)
            if n:
                out[key] = float(n)
        md = [(e, s) for e, s in rows if e.data.get("registry") == "muldimif"]
        if md:
            out.update(self._muldimif_summary(md))
        return out

    def _muldimif_summary(self, rows: Sequence[tuple[Example, Score]]) -> dict[str, float]:
        """The paper's accuracy (all constraints met), per-constraint accuracy, and the
        official per pattern / category / difficulty scores (``get_score``, which leaves out
        groups never fully met: reported here as 0.0)."""
        judges = [list(s.checks["strict"]) for _, s in rows]
        flat = [ok for j in judges for ok in j]
        out = {
            "accuracy": sum(all(j) for j in judges) / len(judges),
            "constraint_accuracy": sum(flat) / max(len(flat), 1),
        }
        items = [
            {
                "constraints": [list(c["triple"]) for c in e.data["constraints"]],
                "judges": [int(ok) for ok in j],
                "constraint_pattern": e.data.get("constraint_pattern", "unknown"),
                "difficulty": e.data.get("difficulty", "unknown"),
            }
            for (e, _), j in zip(rows, judges)
        ]
        return {**out, **muldimif.official_metrics(self._muldimif(), items)}
