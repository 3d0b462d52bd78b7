"""``mrtpo.api.as_overrides``: a mapping's string values reach the config as the same strings."""

from __future__ import annotations

import pytest
from tests.conftest import compose_config

from mrtpo.api import as_overrides

# strings Hydra's grammar would read as something else unquoted, or change when quoted naively
AWKWARD = [
    "true",
    "False",
    "null",
    "123",
    "1e3",
    "-0.5",
    "nan",
    "",
    "a b",
    "[1,2]",
    "{a: 1}",
    "x=y",
    "it's",
    'say "hi"',
    "a\\b",
    "ends with \\",
    "\\'",
    "${trainer.max_steps}",
    "${oc.env:HOME}",
    "a\\${trainer.max_steps}",
    "a\\\\${b}",
    "päth/ünïcode",
    "plain-name_1.2/x:y@z",
]


@pytest.mark.parametrize("text", AWKWARD)
def test_a_string_value_stays_that_string(text):
    (override,) = as_overrides({"+probe.value": text})
    cfg = compose_config("train.yaml", [override])
    assert cfg.probe.value == text and isinstance(cfg.probe.value, str), override


def test_lists_and_scalars_keep_their_types():
    overrides = as_overrides(
        {
            "+probe.items": ["true", 1, None, "${x}"],
            "+probe.n": 3,
            "+probe.b": True,
            "method": "gdpo",
        }
    )
    cfg = compose_config("train.yaml", overrides)
    assert list(cfg.probe["items"]) == ["true", 1, None, "${x}"]
    assert cfg.probe.n == 3 and cfg.probe.b is True
    assert cfg.method._target_.endswith("GDPO")  # a config group's choice, quoted, still picks it
