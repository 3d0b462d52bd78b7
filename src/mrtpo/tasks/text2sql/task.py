"""Text-to-SQL (Spider family, BIRD): prompts, three binary rewards, verifier blocks.

The model reads a question and its database's schema, reasons in ``<think>`` and writes one
SQLite query in ``<answer>`` (SQL-R1's format). Rewards: format, executability, execution
match (``rewards.py``, ``match.py``); queries run in the sandboxed worker pool of
``executor.py``. Verifier blocks, in this order (docs/tasks/text2sql.md): format (always),
executability (why this response's own query gave no result; none when it ran), execution
(always: the reference query).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mrtpo.tasks.base import Example, Score, Task, tag_spans

from .data import Question, SplitConfig, find_database, read_questions, render_schema, table_names
from .executor import RESULT_CAP_KINDS, ExecJob, ExecOutcome, Limits, SQLExecutor
from .match import clean_query, order_matters, prepare_for_match
from .rewards import (
    FORMAT_BLOCK,
    NO_SQL_BLOCK,
    ParsedResponse,
    answer_response,
    error_block,
    parse_response,
    reference_block,
    reference_response,
)

log = logging.getLogger(__name__)

_GOLD_CHECK_VERSION = 2  # bump when the executor's notion of "runs" changes (2: CPU-time budget)
_Usable = list[tuple[Question, Path]]  # questions whose database was found
_Failed = list[tuple[str, str]]  # (question id, why its reference query failed)

SYSTEM_PROMPT = (
    "You are an expert in SQLite. Given a database schema and a question, you write one "
    "SQLite query that answers the question."
)

USER_TEMPLATE = """Database schema:
{schema}

Question: {question}{evidence}

Think through the question step by step inside <think> </think>. Then write the final SQLite \
query inside <answer> </answer> as one ```sql code block, like this:
<think>
...
</think>
<answer>
```sql
SELECT ...
```
</answer>"""


@functools.lru_cache(maxsize=65_536)
def _prepared(query: str, keep_distinct: bool) -> str:
    """Reference queries are prepared once (each is scored G times per step)."""
    return prepare_for_match(query, keep_distinct)


class Text2SQLTask(Task):
    """Text-to-SQL task. Every argument is a key of ``configs/task/text2sql.yaml``, which
    says what it does; ``splits`` maps a split name to :class:`~.data.SplitConfig` fields
    (``train`` is trained on), ``executor`` holds :class:`~.executor.Limits` and ``workers``.
    See ``docs/tasks/text2sql.md``.
    """

    name = "text2sql"
    reward_names = ("format", "executability", "execution")

    def __init__(
        self,
        splits: Mapping[str, Mapping[str, Any]],
        val_split: str = "spider_dev",
        schema_max_chars: int | None = None,
        sample_values: int = 3,
        max_examples: int | None = None,
        keep_distinct: bool = False,
        executor: Mapping[str, Any] | None = None,
        system_prompt: str | None = None,
        cache_dir: str | None = None,
        reference_solutions: str | None = None,
    ) -> None:
        # (a DictConfig works too: from_mapping and Limits read only its scalars and lists)
        self.splits = {str(k): SplitConfig.from_mapping(str(k), c or {}) for k, c in splits.items()}
        self.val_split = val_split
        self.schema_max_chars = int(schema_max_chars or 0)  # 0: no budget
        self.sample_values = int(sample_values)
        self.max_examples = None if max_examples in (None, 0) else int(max_examples)
        self.keep_distinct = bool(keep_distinct)
        self.executor_options = dict(executor or {})
        self.system_prompt = SYSTEM_PROMPT if system_prompt is None else system_prompt
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self._executor: SQLExecutor | None = None
        self.solutions = ReferenceSolutions(reference_solutions)
        self._cache: dict[str, list[Example]] = {}
        #: Per split: how many questions were read, kept and dropped, and why.
        self.load_stats: dict[str, dict[str, Any]] = {}

    # ---- pickling: the worker pool stays behind -----------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_executor": None}

    @property
    def executor(self) -> SQLExecutor:
        if self._executor is None:
            self._executor = SQLExecutor(**self.executor_options)
        return self._executor

    def close(self) -> None:
        """Stop the executor's worker processes."""
        if self._executor is not None:
            self._executor.close()

    # ---- data ---------------------------------------------------------------------------
    def _split_config(self, split: str) -> SplitConfig:
        name = self.val_split if split == "val" else split
        if name not in self.splits:
            valid = sorted({*self.splits, "val"})
            raise ValueError(
                f"unknown text2sql split {split!r}"
                + (f" (task.val_split={self.val_split!r})" if split == "val" else "")
                + f"; valid splits: {valid}. Add it under task.splits or choose another."
            )
        return self.splits[name]

    def examples(self, split: str) -> Sequence[Example]:
        cfg = self._split_config(split)
        if cfg.name not in self._cache:
            self._cache[cfg.name] = self._load(cfg)
        return self._cache[cfg.name]

    def eval_examples(self, split: str, options: Mapping[str, Any]) -> Sequence[Example]:
        """``eval.categories``: database ids to keep. ``eval.limit`` is the evaluation job's
        (``mrtpo.evaluate.job``), which counts the whole split before taking its first N."""
        examples = list(self.examples(split))
        options = options or {}
        if categories := options.get("categories"):
            wanted = {str(c) for c in ([categories] if isinstance(categories, str) else categories)}
            examples = [e for e in examples if e.data["db_id"] in wanted]
            if not examples:
                raise ValueError(
                    f"eval.categories={sorted(wanted)} selects no {split!r} example; for "
                    "text2sql the categories are database ids (db_id)"
                )
        limit = options.get("max_examples")
        return examples[: int(limit)] if limit else examples

    def _load(self, cfg: SplitConfig) -> list[Example]:
        questions = read_questions(cfg)
        stats: dict[str, Any] = {"read": len(questions)}
        missing: Counter[str] = Counter()
        usable: _Usable = []
        for q in questions:
            path = find_database(cfg.db_dir, q.db_id)
            if path is None:
                missing[q.db_id] += 1
            else:
                usable.append((q, path))
        if not usable:
            raise FileNotFoundError(
                f"text2sql split '{cfg.name}': none of the {len(questions)} questions has its "
                f"database under {cfg.db_dir}; set task.splits.{cfg.name}.db_dir"
            )
        stats["missing_database"] = sum(missing.values())
        stats["missing_databases"] = dict(missing)
        failed: _Failed = []
        if cfg.drop_failing_gold:
            usable, failed = self._drop_failing_cached(cfg, usable)
        elif self.max_examples is not None:
            usable = usable[: self.max_examples]
        stats["gold_fails"] = len(failed)
        stats["gold_failures"] = failed
        examples = [self._example(cfg, q, path) for q, path in usable]
        stats["kept"] = len(examples)
        self.load_stats[cfg.name] = stats
        log.info(
            "text2sql %s: kept %d of %d questions%s; dropped %d whose database is missing %s "
            "and %d whose reference query fails to execute %s",
            cfg.name,
            len(examples),
            len(questions),
            f" (task.max_examples={self.max_examples})" if self.max_examples else "",
            stats["missing_database"],
            dict(missing) or "",
            len(failed),
            [f"{qid}: {why}" for qid, why in failed][:10] or "",
        )
        return examples

    def _gold_cache_file(self, cfg: SplitConfig, usable: _Usable) -> Path | None:
        """Cache file named by the question file, every database used (path, size, mtime) and
        the executor's limits."""
        if self.cache_dir is None or self.max_examples is not None or not cfg.file:
            return None
        try:
            st = Path(cfg.file).stat()
            dbs = sorted({str(p.resolve()) for _, p in usable})
            db_ids = [[d, os.stat(d).st_size, os.stat(d).st_mtime_ns] for d in dbs]
        except OSError:
            return None
        key = [str(Path(cfg.file).resolve()), st.st_size, st.st_mtime_ns, db_ids]
        # the limits decide whether a reference runs (built here: no executor for a cache hit)
        options = {k: v for k, v in self.executor_options.items() if k != "workers"}
        limits = dataclasses.asdict(Limits(**options))
        key += [cfg.question_field, self.keep_distinct, limits, _GOLD_CHECK_VERSION]
        digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
        return self.cache_dir / "text2sql" / f"gold_check_{cfg.name}_{digest}.json"

    def _drop_failing_cached(self, cfg: SplitConfig, usable: _Usable) -> tuple[_Usable, _Failed]:
        """:meth:`_drop_failing`, remembered in ``cache_dir`` for the same question file."""
        cache = self._gold_cache_file(cfg, usable)
        if cache is not None and cache.is_file():
            try:
                failed = [tuple(x) for x in json.loads(cache.read_text())["failed"]]
                bad = {qid for qid, _ in failed}
                log.info("text2sql %s: reference checks read from %s", cfg.name, cache)
                return [(q, p) for q, p in usable if q.id not in bad], failed  # type: ignore[misc]
            except (ValueError, KeyError, TypeError):
                log.warning("text2sql: ignoring unreadable cache %s", cache)
        kept, failed = self._drop_failing(usable)
        if cache is not None:
            try:
                cache.parent.mkdir(parents=True, exist_ok=True)
                cache.write_text(json.dumps({"failed": failed}))
            except OSError as exc:
                log.warning("text2sql: cannot write %s (%s)", cache, exc)
        return kept, failed

    def _drop_failing(self, usable: _Usable) -> tuple[_Usable, _Failed]:
        """Run every reference query (and its DISTINCT-free form); keep those that run.

        With ``max_examples`` only as many chunks are checked as needed to fill it.
        """
        kept: _Usable = []
        failed: _Failed = []
        want = self.max_examples
        chunk = len(usable) if want is None else max(4 * want, 64)
        for start in range(0, len(usable), chunk):
            part = usable[start : start + chunk]
            jobs = [
                ExecJob(
                    db=str(path),
                    pred=clean_query(q.query),
                    pred_match=prepare_for_match(q.query, self.keep_distinct),
                )
                for q, path in part
            ]
            for (q, path), out in zip(part, self.executor.run(jobs), strict=True):
                if out.pred_ok and not out.match_error:
                    kept.append((q, path))
                else:
                    failed.append((q.id, out.pred_error or out.match_error or "unknown"))
            if want is not None and len(kept) >= want:
                return kept[:want], failed
        return kept, failed

    def _example(self, cfg: SplitConfig, q: Question, db_path: Path) -> Example:
        schema = render_schema(str(db_path), self.schema_max_chars, self.sample_values)
        evidence = f"\nExternal knowledge: {q.evidence.strip()}" if q.evidence.strip() else ""
        user = USER_TEMPLATE.format(schema=schema, question=q.question.strip(), evidence=evidence)
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages.append({"role": "user", "content": user})
        tables = [
            t
            for t in table_names(str(db_path))
            if re.search(rf"(?<![\w\"`]){re.escape(t)}(?![\w\"`])", q.query, re.IGNORECASE)
        ]
        data = {
            "db_id": q.db_id,
            "db_path": str(db_path.resolve()),
            "query": q.query,
            "question": q.question,
            "split": cfg.name,
            "match": cfg.match_mode,
        }
        if q.evidence:
            data["evidence"] = q.evidence
        if q.difficulty is not None:
            data["difficulty"] = str(q.difficulty)
        reference = reference_response(q.question, q.query, tables)
        return Example(id=q.id, messages=messages, data=data, reference=reference)

    def teacher_messages(self, example: Example):
        """The base class's teacher context around ``task.reference_solutions``' solution."""
        d = example.data
        ref = self.solutions.reference(d["db_id"], d["question"], example.reference)
        if ref is None:
            return None
        return super().teacher_messages(dataclasses.replace(example, reference=ref))

    # ---- rewards -----------------------------------------------------------------------
    def score(self, example: Example, response: str) -> Score:
        return self.score_many([example], [response])[0]

    def score_many(self, examples: Sequence[Example], responses: Sequence[str]) -> list[Score]:
        """Parse every response here, execute all queries in parallel in the worker pool."""
        if len(examples) != len(responses):
            raise ValueError(f"{len(examples)} examples but {len(responses)} responses")
        parsed: list[ParsedResponse | None] = []
        for r in responses:
            try:
                parsed.append(parse_response(r))
            except Exception as exc:  # defensive: parsing is pure string work
                log.warning("text2sql: could not parse a response: %r", exc)
                parsed.append(None)
        jobs: dict[int, ExecJob] = {}  # by response
        max_chars = self.executor.limits.max_query_chars
        for i, (ex, p) in enumerate(zip(examples, parsed, strict=True)):
            if p is None or p.sql is None:
                continue
            gold = _prepared(ex.data["query"], self.keep_distinct)
            if len(p.sql) > max_chars:  # refused unread by the executor: skip the clean-up
                pred, pred_match = p.sql, None
            else:
                pred, pred_match = clean_query(p.sql), prepare_for_match(p.sql, self.keep_distinct)
            jobs[i] = ExecJob(
                db=ex.data["db_path"],
                pred=pred,
                pred_match=pred_match,
                gold=gold,
                ordered=order_matters(gold),
                mode=ex.data.get("match", "spider"),
            )
        try:
            ran = self.executor.run(list(jobs.values())) if jobs else []
            outcomes = dict(zip(jobs, ran, strict=True))
        except Exception as exc:  # the pool itself failed: no reward can be trusted
            msg = f"executor failure: {type(exc).__name__}: {exc}"
            log.error("text2sql: %s", msg)
            return [Score(rewards=dict.fromkeys(self.reward_names), error=msg) for _ in examples]
        scores = []
        for i, (ex, p) in enumerate(zip(examples, parsed, strict=True)):
            try:
                if p is None:
                    raise ValueError("response could not be parsed")
                scores.append(self._assemble(ex, p, outcomes.get(i)))
            except Exception as exc:
                msg = f"{type(exc).__name__}: {exc}"
                log.warning("text2sql: scoring failed for example %s: %s", ex.id, msg)
                scores.append(Score(rewards=dict.fromkeys(self.reward_names), error=msg))
        return scores

    def _assemble(self, ex: Example, p: ParsedResponse, out: ExecOutcome | None) -> Score:
        rewards = {"format": 1.0 if p.format_ok else 0.0, "executability": 0.0, "execution": 0.0}
        reasons = {"format": p.format_reason} if p.format_reason else {}
        blocks: dict[str, str | None] = {
            "format": FORMAT_BLOCK,
            "executability": None,
            "execution": reference_block(ex.data["query"]),
        }
        checks: dict[str, Any] = {"db": ex.data["db_id"]}
        if out is None:  # no query in the answer
            reasons["executability"] = p.sql_reason or "no SQL code block inside <answer>"
            reasons["execution"] = "no query to execute"
            blocks["executability"] = NO_SQL_BLOCK
            return Score(rewards=rewards, blocks=blocks, reasons=reasons, checks=checks)
        checks["exec_seconds"] = round(out.seconds, 4)
        # what executability measured on the way: logged as train/extra/executability/<name>
        extras = {
            "executability": {"sql_chars": float(len(p.sql or "")), "exec_seconds": out.seconds}
        }
        if out.gold_error:
            checks["gold_error"] = out.gold_error
        if not out.pred_ok:
            checks["error_kind"] = out.pred_error_kind
        if not out.pred_ok and out.pred_error_kind in RESULT_CAP_KINDS:
            # SQLite ran it without error; the executor stopped reading a result too large
            # to compare. Executable (as the official evaluator would find it), not matched.
            rewards["executability"] = 1.0
            reasons["execution"] = f"not compared: {out.pred_error}"
        elif not out.pred_ok:
            error = out.pred_error or "unknown error"
            reasons["executability"] = error
            reasons["execution"] = "the query did not run"
            blocks["executability"] = error_block(error, out.pred_error_kind)
        else:
            rewards["executability"] = 1.0
            rewards["execution"] = 1.0 if out.match else 0.0
            checks["rows"] = out.pred_rows
            if not out.match:
                if out.gold_error:
                    reasons["execution"] = f"the reference query failed: {out.gold_error}"
                elif out.match_error:
                    reasons["execution"] = f"the query without DISTINCT failed: {out.match_error}"
                else:
                    reasons["execution"] = (
                        f"the result differs from the reference's ({out.pred_rows} rows vs "
                        f"{out.gold_rows})"
                    )
        return Score(rewards=rewards, blocks=blocks, reasons=reasons, checks=checks, extras=extras)

    # ---- evaluation --------------------------------------------------------------------
    def segments(self, response: str) -> dict[str, list[tuple[int, int]]]:
        """The reasoning (``think``) and the query (``answer``), tags included."""
        return tag_spans(response, ("think", "answer"))

    def summarize(self, examples: Sequence[Example], scores: Sequence[Score]) -> dict[str, float]:
        """``exec_acc`` overall and per database (and per BIRD difficulty), reward means.

        A response whose scoring failed counts as wrong in ``exec_acc``.
        """
        out = super().summarize(examples, scores)
        if not scores:
            return out
        groups: dict[str, list[float]] = defaultdict(list)
        for ex, s in zip(examples, scores, strict=True):
            hit = 1.0 if s.rewards.get("execution") == 1.0 else 0.0
            groups["exec_acc"].append(hit)
            groups[f"exec_acc/{ex.data.get('db_id')}"].append(hit)
            if ex.data.get("difficulty"):
                groups[f"exec_acc_difficulty/{ex.data['difficulty']}"].append(hit)
        out.update({k: sum(v) / len(v) for k, v in sorted(groups.items())})
        out["n_databases"] = float(len({ex.data.get("db_id") for ex in examples}))
        return out


# ---- reference solutions (method=opsd) -----------------------------------------------------
# OmniSQL's chain-of-thought solutions (Li et al., arXiv 2503.02240; docs/tasks/text2sql.md,
# "Prompt"), whose last ```sql block is the answer (as OmniSQL's ``post_process_cot.py`` reads
# it). The archive's ``data/train_spider.json`` (``input_seq``/``output_seq`` only) cannot be
# matched to questions.

GOLD = "gold"
KEY = "task.reference_solutions"
RELEASE = "data/spider/train_spider_enhanced_with_cot.json of seeklhy/OmniSQL-datasets (data.zip)"

_SQL_BLOCK = re.compile(r"```sql\s*(.*?)\s*```", re.DOTALL | re.IGNORECASE)


def question_key(db_id: str, question: str) -> tuple[str, str]:
    return str(db_id), " ".join(str(question).split()).casefold()


def to_answer_format(cot: str) -> str | None:
    """An OmniSQL solution in this task's format: ``<think>reasoning</think>`` then the last
    ```` ```sql ```` block inside ``<answer>``. None when the text has no SQL block."""
    blocks = list(_SQL_BLOCK.finditer(cot or ""))
    if not blocks:
        return None
    last = blocks[-1]
    sql = last.group(1).strip()
    if not sql:
        return None
    return answer_response(cot[: last.start()].strip(), sql)


def load_solutions(path: str | Path) -> tuple[dict[tuple[str, str], str], dict[str, int]]:
    """``{(db_id, question key): solution in the answer format}`` and counts (rows read,
    kept, without a usable SQL block, duplicates)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(
            f"{KEY}={str(path)!r}: no such file. Point it at OmniSQL's Spider-train "
            f"solutions ({RELEASE}), set {KEY}=gold for the gold-query fallback, or leave it "
            "null (then method=opsd is refused)"
        )
    with open(p, encoding="utf-8") as f:
        rows: Any = json.load(f)
    if not isinstance(rows, list):
        raise ValueError(f"{KEY}: {p} is not a JSON list of rows (expected {RELEASE})")
    out: dict[tuple[str, str], str] = {}
    stats = {"read": len(rows), "kept": 0, "no_sql_block": 0, "duplicates": 0}
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or not {"db_id", "question", "cot"} <= set(row):
            keys = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise ValueError(
                f"{KEY}: row {i} of {p} lacks db_id/question/cot (has {keys}); expected the "
                f"rows of {RELEASE}"
            )
        text = to_answer_format(str(row["cot"]))
        if text is None:
            stats["no_sql_block"] += 1
            continue
        key = question_key(row["db_id"], row["question"])
        if key in out:
            stats["duplicates"] += 1  # the same question twice in Spider train: keep the first
            continue
        out[key] = text
        stats["kept"] += 1
    return out, stats


class ReferenceSolutions:
    """The teacher's reference for each training question, from ``task.reference_solutions``
    (None: none configured; ``"gold"``: the gold query in the answer format; else a path)."""

    def __init__(self, setting: str | None) -> None:
        self.setting = None if setting in (None, "") else str(setting)
        self.stats: dict[str, int] = {}

    @functools.cached_property
    def _solutions(self) -> dict[tuple[str, str], str]:
        table, self.stats = load_solutions(self.setting or "")
        log.info(
            "text2sql: %(kept)d OmniSQL reference solutions read from %(path)s (%(read)d "
            "rows, %(no_sql_block)d without a SQL block, %(duplicates)d duplicates)",
            {**self.stats, "path": self.setting},
        )
        return table

    def reference(self, db_id: str, question: str, gold_reference: str | None) -> str | None:
        if self.setting is None:
            raise ValueError(
                f"method=opsd on task=text2sql needs a reference solution per question for the "
                f"teacher's context, and {KEY} is not set: set it to the path of OmniSQL's "
                f"Spider-train solutions ({RELEASE}), or {KEY}=gold for the fallback (the "
                "gold query in the answer format; not the paper's setting)"
            )
        if self.setting == GOLD:
            return gold_reference
        return self._solutions.get(question_key(db_id, question))
