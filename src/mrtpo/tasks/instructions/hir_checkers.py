"""HiR's checker variants, as small adapters around the official checker classes.

HIR-16K is scored with the authors' own copies of IFEval and IFBench (github.com/sastpg/HIR,
``evaluation/IFEval``, ``evaluation/IFBench`` at a06c51f; their trainer imports the copies under
``HIR/verl/utils/reward_score/if_score``). Three differences from the benchmark checkers used
here (lm-eval's IFEval, if-verifiable's IFBench) change verdicts on ordinary responses:

* ``language:response_language``: HiR adds ``zh`` (the official table cannot even build it) and
  maps langdetect's ``zh-cn`` to ``zh``, so a Chinese answer to "respond in zh" passes.
* ``detectable_format:constrained_response``: five Chinese answers ("我的答案是肯定的", ...) pass
  besides "My answer is yes./no./maybe.".
* ``repeat:repeat_change`` (IFBench): HiR's older copy drops the first *character* of request and
  response (``p[1:] == r[1:]``); the current checker drops the first *word*.

Each adapter overrides only ``check_following``, so arguments and descriptions stay official.
Not reproduced: a few IFBench copies raise on empty sentences or paragraphs where the official
one returns a verdict; a raising checker counts as not followed here, as HiR's reward treats the
whole response. Used for HIR-16K training only (``task.data.checkers: hir``); benchmarks always
use the official checkers.
"""

from __future__ import annotations

from collections.abc import Mapping

# HiR's extra options for detectable_format:constrained_response (its _CONSTRAINED_RESPONSE_OPTIONS).
HIR_CHINESE_ANSWERS = (
    "我的答案是肯定的",
    "我的答案是否定的",
    "我的答案是可能",
    "我的答案是也许",
    "我的答案是不确定",
)


def _language_adapter(official: type) -> type:
    class HirResponseLanguageChecker(official):  # type: ignore[misc, valid-type]
        """Official check, plus HiR's ``zh`` entry and its ``zh-cn`` -> ``zh`` mapping."""

        def build_description(self, *, language: str | None = None) -> str:
            if language != "zh":
                return super().build_description(language=language)
            self._language = "zh"
            self._description_pattern = (
                "Your ENTIRE response should be in {language} language, no other "
                "language is allowed."
            )
            return self._description_pattern.format(language="Chinese")

        def get_instruction_args(self) -> dict:
            return {"language": self._language}

        def check_following(self, value: str) -> bool:
            if super().check_following(value):
                return True
            if getattr(self, "_language", None) != "zh":
                return False
            import langdetect

            try:
                return langdetect.detect(value) == "zh-cn"
            except langdetect.LangDetectException:
                return True  # both versions count an undetectable language as followed

    return HirResponseLanguageChecker


def _constrained_adapter(official: type) -> type:
    class HirConstrainedResponseChecker(official):  # type: ignore[misc, valid-type]
        """Official options, plus HiR's Chinese answers."""

        def check_following(self, value: str) -> bool:
            if super().check_following(value):
                return True
            text = value.strip()
            return any(option in text for option in HIR_CHINESE_ANSWERS)

    return HirConstrainedResponseChecker


def _repeat_change_adapter(official: type) -> type:
    class HirRepeatChangeChecker(official):  # type: ignore[misc, valid-type]
        """HiR's older comparison: equal after dropping the first character."""

        def check_following(self, value: str) -> bool:
            prompt = self._prompt_to_repeat
            if prompt == value:
                return False
            return prompt[1:] == value[1:]

    return HirRepeatChangeChecker


ADAPTERS = {
    "ifeval": {
        "language:response_language": _language_adapter,
        "detectable_format:constrained_response": _constrained_adapter,
    },
    "ifbench": {"repeat:repeat_change": _repeat_change_adapter},
}


def hir_instructions(registry: str, official: Mapping[str, type]) -> dict[str, type]:
    """The official instruction table with HiR's variants swapped in."""
    table = dict(official)
    for iid, make in ADAPTERS.get(registry, {}).items():
        if iid in table:
            table[iid] = make(table[iid])
    return table
