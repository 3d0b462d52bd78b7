"""Fuzzing every task's reward, block and parse functions with hostile model output.

Whatever a policy writes — random unicode, megabyte strings, nested or unclosed tags, JSON
bombs, NUL bytes — scoring must return rewards (a wrong answer is a 0 with a reason, never an
exception) within a time bound. The harness is generic: it finds the tasks in
``configs/task/*.yaml`` (composed like the real config, with the shared data) and, in each
task's package, the public functions that take model text (one required ``str`` parameter
named like a response).

Data: the public files in ``../shared/data`` where they exist; otherwise small stand-ins that
``tests/task_fixtures.py`` builds (SQLite databases and Spider-shaped questions, RLLA rows),
so the text-to-SQL and tool-calling verifiers are fuzzed on a user's clone too. The synthetic
task and the instruction task's generated prompts need no files. A task that still cannot
load is skipped on its own tests only, with the reason.

Every parser of model output must run in time linear in its length: on the worst inputs found
so far (an unclosed code fence followed by spaces, a long digit run ending in a letter, ...)
making the input ``GROWTH`` times longer may cost at most ``MAX_SLOWDOWN`` times more. This is
a ratio of two timings taken back to back, so a loaded machine slows both alike; a quadratic
parser costs ``GROWTH**2`` times more and fails by a wide margin.

``Task.score`` and ``Task.contexts`` must never raise. Parse helpers may signal bad input
with a ``ValueError`` (their callers catch it); any other exception is a bug.
"""

from __future__ import annotations

import atexit
import importlib
import inspect
import math
import pkgutil
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf.errors import MissingMandatoryValue
from tests.conftest import CONFIG_DIR, SHARED_DATA, compose_config
from tests.task_fixtures import make_public_data

from mrtpo.tasks.base import Contexts, Score, Task

TASKS = sorted(p.stem for p in (CONFIG_DIR / "task").glob("*.yaml"))
SCORE_BOUND_S = 20.0  # one score call; text-to-SQL runs the query (5 s statement limit)
HELPER_BOUND_S = 5.0  # one parse-helper call
TEXT_PARAMS = {"response", "text", "completion", "block", "sql"}  # model-written text

MB = 1_000_000
HOSTILE: dict[str, str] = {
    "empty": "",
    "whitespace": " \t\r\n\u00a0\u2028\u3000",
    "nul_bytes": "\x00" * 16 + "<answer>\x00SELECT\x00 1</answer>\x00",
    "control_chars": "".join(chr(i) for i in range(32)) + "\x7f\x85",
    "lone_surrogates": "\ud800 abc \udfff",
    "bidi_zero_width": "\u202eSELECT\u200b * \ufeffFROM\u2066 t",
    "combining_marks": "a" + "\u0301" * 20_000,
    "emoji": "👍🏽🧑‍🚀" * 2_000,
    "megabyte_plain": "a" * MB,
    "megabyte_words": "apple river " * (MB // 12),
    "megabyte_lines": "\n" * MB,
    "megabyte_open_tags": "<answer>" * (MB // 8),
    "nested_think": "<think>" * 20_000 + "x" + "</think>" * 19_999,
    "unbalanced_tags": "</answer><answer></think><tool_call><response></tool_call>" * 5_000,
    "fences": "```sql\n" * 50_000,
    "json_bomb_list": "<tool_call>\n" + "[" * 100_000 + "]" * 100_000 + "\n</tool_call>",
    "json_bomb_object": '<tool_call>\n{"a":' * 1 + '{"a":' * 50_000 + "1" + "}" * 50_001,
    "json_huge_int": '<tool_call>\n{"name": "f", "arguments": {"x": ' + "9" * 100_000 + "}}\n"
    "</tool_call>",
    "json_nan_inf": '<tool_call>\n{"name": NaN, "arguments": {"x": Infinity, "y": -1e999}}\n'
    "</tool_call>",
    "json_many_calls": "<tool_call>\n"
    + '{"name": "f", "arguments": {}}\n' * 20_000
    + "</tool_call>",
    "json_wrong_types": '<tool_call>\n[1, "a", null]\n{"name": 3, "arguments": [1]}\n'
    '{"name": "f", "arguments": "x"}\n"str"\n</tool_call>',
    "sql_recursive_cte": "<think>x</think><answer>```sql\nWITH RECURSIVE c(x) AS (SELECT 1 "
    "UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c;\n```</answer>",
    "sql_deep_expression": "<answer>```sql\nSELECT "
    + "(" * 5_000
    + "1"
    + ")" * 5_000
    + "\n```</answer>",
    "sql_write_attempts": "<answer>```sql\nATTACH DATABASE '/tmp/fuzz_attach.db' AS x; CREATE "
    "TABLE x.t(a); DROP TABLE singer; PRAGMA writable_schema=1;\n```</answer>",
    "sql_many_statements": "<answer>```sql\n" + "SELECT 1;" * 20_000 + "\n```</answer>",
    "sql_huge_literal": "<answer>```sql\nSELECT '" + "x" * MB + "'\n```</answer>",
    "sql_zeroblob": "<answer>```sql\nSELECT zeroblob(2000000000), randomblob(1000000000)\n```</answer>",
    "format_tags_only": "<think></think><answer></answer><tool_call></tool_call><response></response>",
    "template_markers": "<|im_start|>system\nignore<|im_end|><|endoftext|>" * 100,
    "format_strings": "%s %n {0} {} ${x} {{}} \\x00 \\u0000",
}


# ---- tasks ------------------------------------------------------------------------------


_DATA_DIR: list[Path] = []


def data_dir() -> Path:
    """``../shared/data`` when present, else the stand-ins of ``tests/task_fixtures.py``
    (built once per session in a temporary folder)."""
    if SHARED_DATA.is_dir():
        return SHARED_DATA
    if not _DATA_DIR:
        _DATA_DIR.append(make_public_data(_scratch("fuzz-data-")))
    return _DATA_DIR[0]


def _scratch(prefix: str) -> Path:
    """A temporary folder removed when the test process exits (these helpers run outside
    fixtures, cached per session; mkdtemp alone left one behind per task)."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def _load(name: str) -> tuple[Task, list]:
    from hydra.utils import instantiate

    cache = _scratch("fuzz-cache-")
    cfg = compose_config(
        "train.yaml",
        [
            f"task={name}",
            f"paths.data_dir={data_dir()}",
            f"paths.cache_dir={cache}",
            f"paths.output_dir={cache}",
        ],
    )
    try:
        task = instantiate(cfg.task)
    except FileNotFoundError as exc:
        pytest.skip(f"task {name}: data missing under {data_dir()} ({exc})")
    except MissingMandatoryValue as exc:  # a template config: the user must fill in a key
        pytest.skip(f"task {name}: its config needs a value first ({exc.full_key} is ???)")
    missing = []
    for split in ("val", "train"):
        try:
            examples = list(task.examples(split))
        except FileNotFoundError as exc:
            missing.append(f"{split}: {exc}")
            continue
        if examples:
            # a few different prompts: first, middle, last
            picks = sorted({0, len(examples) // 2, len(examples) - 1})
            return task, [examples[i] for i in picks]
    pytest.skip(f"task {name}: no examples in its val or train split here ({missing})")


_LOADED: dict[str, tuple[Task, list]] = {}


def loaded(name: str) -> tuple[Task, list]:
    if name not in _LOADED:
        _LOADED[name] = _load(name)
    return _LOADED[name]


def text_helpers(task: Task) -> list[Callable[[str], object]]:
    """Public functions of the task's package that take one model-written string."""
    pkg_name = type(task).__module__.rsplit(".", 1)[0]
    pkg = importlib.import_module(pkg_name)
    names = [pkg_name]
    if hasattr(pkg, "__path__"):
        names += [f"{pkg_name}.{m.name}" for m in pkgutil.iter_modules(pkg.__path__)]
    found = []
    for mod_name in names:
        mod = importlib.import_module(mod_name)
        for fname, fn in sorted(vars(mod).items()):
            if fname.startswith("_") or not inspect.isfunction(fn) or fn.__module__ != mod_name:
                continue
            params = [
                p
                for p in inspect.signature(fn).parameters.values()
                if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            ]
            if (
                len(params) == 1
                and params[0].name in TEXT_PARAMS
                and params[0].annotation in ("str", str)
            ):
                found.append(fn)
    return found


# ---- checks -----------------------------------------------------------------------------


def _timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def _label(text: str) -> str:
    return repr(text[:120]) + (f"... ({len(text)} chars)" if len(text) > 120 else "")


def check_score(task: Task, example, text: str) -> None:
    try:
        score, took = _timed(task.score, example, text)
    except Exception as exc:
        pytest.fail(
            f"task {task.name}: score() raised {type(exc).__name__}: {exc} on example "
            f"{example.id} for response {_label(text)}"
        )
    assert took < SCORE_BOUND_S, f"task {task.name}: score took {took:.1f}s on {_label(text)}"
    assert isinstance(score, Score)
    assert set(score.rewards) <= set(task.reward_names), score.rewards
    for k, v in score.rewards.items():
        assert v is None or (isinstance(v, (int, float)) and not math.isinf(v)), (k, v)
    for k, b in score.blocks.items():
        assert b is None or isinstance(b, str), (k, type(b))
    try:
        ctx, took = _timed(task.contexts, example, score)
    except Exception as exc:
        pytest.fail(
            f"task {task.name}: contexts() raised {type(exc).__name__}: {exc} on example "
            f"{example.id} for response {_label(text)}"
        )
    assert took < SCORE_BOUND_S
    assert isinstance(ctx, Contexts)
    for messages in [ctx.all, ctx.none, *ctx.without.values()]:
        assert all(isinstance(m.get("content"), str) for m in messages)
    assert set(ctx.without) <= set(task.reward_names)


def check_helper(fn, text: str) -> None:
    name = f"{fn.__module__}.{fn.__name__}"
    t0 = time.perf_counter()
    try:
        fn(text)
    except ValueError:
        pass  # the documented way to say "not parseable"; callers turn it into a reward
    except Exception as exc:
        pytest.fail(f"{name} raised {type(exc).__name__}: {exc} on {_label(text)}")
    took = time.perf_counter() - t0
    assert took < HELPER_BOUND_S, f"{name} took {took:.1f}s on {_label(text)}"


# ---- hostile corpus ---------------------------------------------------------------------


# Known failures found by this harness, as {(task, case): reason}; marked strict, so a fixed
# one turns into a failure and its entry must go. (The toolcall JSON-bomb escapes it found
# are fixed.)
KNOWN_FAILURES: dict[tuple[str, str], str] = {}


def _params(cases: list[str]) -> list:
    out = []
    for name in TASKS:
        for case in cases:
            reason = KNOWN_FAILURES.get((name, case))
            marks = [pytest.mark.xfail(reason=reason, strict=True)] if reason else []
            out.append(pytest.param(name, case, marks=marks, id=f"{name}-{case}"))
    return out


@pytest.mark.parametrize(("name", "case"), _params(sorted(HOSTILE)))
def test_score_and_contexts_survive_hostile_text(name, case):
    task, examples = loaded(name)
    check_score(task, examples[0], HOSTILE[case])


@pytest.mark.parametrize(("name", "case"), _params(["parse_helpers"]))
def test_parse_helpers_survive_hostile_text(name, case):
    task, _ = loaded(name)
    for fn in text_helpers(task):
        for text in HOSTILE.values():
            check_helper(fn, text)


@pytest.mark.parametrize("name", TASKS)
def test_score_many_survives_a_hostile_batch(name):
    task, examples = loaded(name)
    texts = list(HOSTILE.values())
    exs = [examples[i % len(examples)] for i in range(len(texts))]
    t0 = time.perf_counter()
    try:
        scores = task.score_many(exs, texts)
    except Exception as exc:
        pytest.fail(f"task {name}: score_many raised {type(exc).__name__}: {exc}")
    assert time.perf_counter() - t0 < SCORE_BOUND_S * 3
    assert len(scores) == len(texts)
    assert all(isinstance(s, Score) for s in scores)


# ---- generated text ---------------------------------------------------------------------

TOKENS = [
    "<think>",
    "</think>",
    "<answer>",
    "</answer>",
    "<tool_call>",
    "</tool_call>",
    "<response>",
    "</response>",
    "```sql\n",
    "```",
    "\n",
    "{",
    "}",
    "[",
    "]",
    '"',
    ":",
    ",",
    '"name"',
    '"arguments"',
    '"parameters"',
    "SELECT",
    "FROM",
    "WHERE",
    ";",
    "'",
    "--",
    "/*",
    "\x00",
    "NaN",
    "1e999",
    "apple",
    "<|im_end|>",
]

tagged_text = st.lists(st.one_of(st.sampled_from(TOKENS), st.text(max_size=12)), max_size=60).map(
    "".join
)
json_like = st.recursive(
    st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=8),
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4)
    ),
    max_leaves=20,
).map(lambda v: "<tool_call>\n" + repr(v).replace("'", '"') + "\n</tool_call>")
any_text = st.one_of(st.text(max_size=400), tagged_text, json_like)


@pytest.mark.parametrize("name", TASKS)
def test_score_survives_generated_text(name):
    task, examples = loaded(name)

    @settings(
        max_examples=40,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(text=any_text, which=st.integers(min_value=0, max_value=len(examples) - 1))
    def run(text: str, which: int) -> None:
        check_score(task, examples[which], text)

    run()


@pytest.mark.parametrize("name", TASKS)
def test_parse_helpers_survive_generated_text(name):
    task, _ = loaded(name)
    helpers = text_helpers(task)
    if not helpers:
        pytest.skip(f"task {name}: no parse helpers found")

    @settings(max_examples=60, deadline=None, database=None)
    @given(text=any_text)
    def run(text: str) -> None:
        for fn in helpers:
            check_helper(fn, text)

    run()


# ---- linear worst cases ---------------------------------------------------------------------

SMALL_N = 8_000
GROWTH = 8
MAX_SLOWDOWN = 24  # linear costs ~8x, quadratic 64x
FAST_ENOUGH_S = 0.2  # below this at the large size nothing is worth timing


def _worst_cases() -> dict[str, Callable[[int], object]]:
    """Inputs of ``n`` characters that made a model-output parser quadratic (or could)."""
    from mrtpo.tasks.instructions.judge import JudgeError, parse_verdicts
    from mrtpo.tasks.text2sql.executor import Limits, precheck
    from mrtpo.tasks.text2sql.match import clean_query, prepare_for_match
    from mrtpo.tasks.text2sql.rewards import parse_response
    from mrtpo.tasks.toolcall.parsing import coerce_value
    from mrtpo.tasks.toolcall.rewards import correctness_reward, format_reward

    unlimited = Limits(max_query_chars=10 * SMALL_N * GROWTH)

    def judge_reply(text: str) -> object:
        try:
            return parse_verdicts(text, 1)
        except JudgeError:  # an unusable reply: what these inputs are
            return None

    return {
        # issue 15: 64k spaces after an unclosed fence took 22 s
        "text2sql/unclosed-fence-spaces": lambda n: parse_response("<answer>```" + " " * n),
        "text2sql/unclosed-labelled-fence": lambda n: parse_response("<answer>```sql" + " " * n),
        "text2sql/fence-tabs-then-text": lambda n: parse_response("<answer>```" + "\t" * n + "x"),
        "text2sql/inline-label-spaces": lambda n: parse_response(
            "<answer>```\n" + " " * n + "x```"
        ),
        "text2sql/many-fences": lambda n: parse_response("<answer>" + "```" * (n // 3)),
        "text2sql/backticks": lambda n: parse_response("<answer>" + "`" * n),
        "text2sql/distinct-after-is": lambda n: prepare_for_match("is" + " " * n),
        "text2sql/unclosed-comments": lambda n: prepare_for_match("/*" * (n // 2)),
        "text2sql/quotes": lambda n: prepare_for_match("'" * n),
        "text2sql/curdate-spaces": lambda n: clean_query("YEAR(" + " " * n),
        "text2sql/precheck-comments": lambda n: precheck("/*" * (n // 2), unlimited),
        "text2sql/precheck-parens": lambda n: precheck("(" * n, unlimited),
        # issue 25: the AdvancedIF judge's reply parser took 3.5 s on 30k "{"
        "instructions/judge-open-braces": lambda n: judge_reply("{" * n),
        "instructions/judge-open-brackets": lambda n: judge_reply("x" + "[" * n),
        "instructions/judge-pairs-then-brace": lambda n: judge_reply("[]" * (n // 2) + "{"),
        # issue 15: 40k digits ending in a non-digit took 44 s (float and int schemas)
        "toolcall/float-digits": lambda n: coerce_value("1" * n + "x", {"type": "float"}),
        "toolcall/float-digits-exponent": lambda n: coerce_value("1" * n + "e", {"type": "number"}),
        "toolcall/int-digits": lambda n: coerce_value("1" * n + "x", {"type": "int"}),
        "toolcall/format-repeated-openings": lambda n: format_reward(
            "<think>" + "</think>\n<tool_call>\n" * (n // 20), ("tool_call",)
        ),
        "toolcall/format-think-only": lambda n: format_reward(
            "<think>" + "</think>x" * (n // 9), ()
        ),
        "toolcall/digit-call-line": lambda n: correctness_reward(
            [{"name": "f", "parameters": {}}], "<tool_call>\n" + "1" * n + "x\n</tool_call>", {}
        ),
    }


def _best_of(fn: Callable[[int], object], n: int, repeats: int = 3) -> float:
    return min(_timed(fn, n)[1] for _ in range(repeats))


def _superlinear(fn: Callable[[int], object], small_n: int = SMALL_N) -> str | None:
    """Why ``fn`` looks worse than linear in ``n``, or None."""
    large = _best_of(fn, small_n * GROWTH)
    if large < FAST_ENOUGH_S:
        return None  # a quadratic parser takes seconds here (22 s and 44 s before the fixes)
    small = _best_of(fn, small_n)
    if large < MAX_SLOWDOWN * small:
        return None
    return (
        f"{GROWTH}x longer input took {large / small:.0f}x longer "
        f"({small:.3f}s at {small_n} characters, {large:.3f}s at {small_n * GROWTH})"
    )


@pytest.mark.parametrize("case", sorted(_worst_cases()))
def test_model_output_parsers_run_in_linear_time(case):
    why = _superlinear(_worst_cases()[case])
    assert why is None, f"{case}: {why}"


def test_the_linearity_check_catches_a_quadratic_parser():
    """A trailing-whitespace regex backtracks quadratically on spaces followed by a letter."""
    import re

    def quadratic(n: int) -> object:
        return re.search(r"\s+$", " " * n + "x")

    assert _superlinear(quadratic, small_n=1_500) is not None
    assert _superlinear(lambda n: ("x" * n).rstrip(), small_n=1_500) is None


def test_the_harness_finds_real_helpers():
    """The discovery has teeth: the synthetic task's word splitter is found and checked."""
    task, _ = loaded("synthetic")
    names = {fn.__name__ for fn in text_helpers(task)}
    assert "response_words" in names
