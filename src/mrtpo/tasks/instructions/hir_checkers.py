"""HiR's checker variants, as small adapters around the official checker classes.

The HIR-16K authors score their training constraints with their own copies of the IFEval
and IFBench checkers (github.com/sastpg/HIR, ``evaluation/IFEval`` and ``evaluation/IFBench``
at commit a06c51f; the copies under ``HIR/verl/utils/reward_score/if_score`` are what their
trainer imports). Compared with the checkers this project uses for benchmarks (lm-eval's
IFEval port, if-verifiable's IFBench port), three differences change a verdict on ordinary
responses:

* ``language:response_language``: HiR's language table adds ``zh`` (Chinese), which the
  official table lacks (there a ``zh`` constraint cannot even be built); and langdetect labels
  simplified Chinese ``zh-cn``, which HiR maps to ``zh`` before comparing, so a Chinese answer
  to "respond in zh" passes.
* ``detectable_format:constrained_response``: HiR also accepts five Chinese answers
  ("我的答案是肯定的", ...) besides "My answer is yes./no./maybe.".
* ``repeat:repeat_change`` (IFBench): HiR's copy is an older version that compares the
  request and the response with their first *character* dropped (``p[1:] == r[1:]``); the
  current checker compares them with the first *word* dropped.

Each adapter subclasses the official class and changes only ``check_following``, so argument
handling and descriptions stay official. Other differences between the copies (error
handling on empty sentences or paragraphs in a few IFBench checkers, where HiR's copy raises
and the official one returns a verdict) are not reproduced: a checker that raises counts as
not followed here, which is also what HiR's reward does for the whole response.

These variants are used for HIR-16K training prompts only (``task.data.checkers: hir``);
benchmark evaluation always uses the official checkers.
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
