"""HiR's checker variants, as small adapters around the official checker classes.

HIR-16K is scored with the authors' own copies of IFEval and IFBench (github.com/sastpg/HIR at
a06c51f), which differ from the benchmark checkers in three places (``zh`` and ``zh-cn`` in
``language:response_language``, Chinese answers in ``detectable_format:constrained_response``,
``repeat:repeat_change`` dropping the first character): docs/tasks/instructions.md has the table
and what is not reproduced. Each adapter overrides only ``check_following``, so arguments and
descriptions stay official. Used for HIR-16K training only (``task.data.checkers: hir``).
"""

from __future__ import annotations

from collections.abc import Mapping

# HiR's extra options for detectable_format:constrained_response (its _CONSTRAINED_RESPONSE_OPTIONS).
HIR_CHINESE_ANSWERS = tuple(
    f"我的答案是{a}" for a in ("肯定的", "否定的", "可能", "也许", "不确定")
)


class _Language:
    """Official check, plus HiR's ``zh`` entry and its ``zh-cn`` -> ``zh`` mapping."""

    def build_description(self, *, language: str | None = None) -> str:
        if language != "zh":
            return super().build_description(language=language)  # type: ignore[misc]
        self._language = "zh"
        self._description_pattern = (
            "Your ENTIRE response should be in {language} language, no other language is allowed."
        )
        return self._description_pattern.format(language="Chinese")

    def get_instruction_args(self) -> dict:
        return {"language": self._language}

    def check_following(self, value: str) -> bool:
        if super().check_following(value):  # type: ignore[misc]
            return True
        if getattr(self, "_language", None) != "zh":
            return False
        import langdetect

        try:
            return langdetect.detect(value) == "zh-cn"
        except langdetect.LangDetectException:
            return True  # both versions count an undetectable language as followed


class _Constrained:
    """Official options, plus HiR's Chinese answers."""

    def check_following(self, value: str) -> bool:
        ok = super().check_following(value)  # type: ignore[misc]
        return ok or any(o in value.strip() for o in HIR_CHINESE_ANSWERS)


class _RepeatChange:
    """HiR's older comparison: equal after dropping the first character."""

    def check_following(self, value: str) -> bool:
        prompt = self._prompt_to_repeat  # type: ignore[attr-defined]
        return prompt != value and prompt[1:] == value[1:]


ADAPTERS = {
    "ifeval": {
        "language:response_language": _Language,
        "detectable_format:constrained_response": _Constrained,
    },
    "ifbench": {"repeat:repeat_change": _RepeatChange},
}


def hir_instructions(registry: str, official: Mapping[str, type]) -> dict[str, type]:
    """The official instruction table with HiR's variants (each official class under one of
    the adapters above) swapped in."""
    table = dict(official)
    for iid, adapter in ADAPTERS.get(registry, {}).items():
        if iid in table:
            table[iid] = type(f"Hir{table[iid].__name__}", (adapter, table[iid]), {})
    return table
