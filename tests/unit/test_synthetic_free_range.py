"""The long toy's free part with no fixed length (issue 49, item 4): ``task.free_tokens`` as a
range ``[fewest, most]`` draws each prompt's free-part length, so when to close the free part
cannot be learned by counting; a single count keeps every reference as it was."""

from __future__ import annotations

from hydra.utils import instantiate

from mrtpo.tasks.synthetic.task import CLOSE, OPEN, SyntheticTask, split_free


def _task(free, seed=0, **kw) -> SyntheticTask:
    kw = {"num_constraints": 8, "num_train": 200, "closing_mark": True, **kw}
    return SyntheticTask(seed=seed, free_tokens=free, **kw)


def _lengths(task: SyntheticTask, split: str = "train") -> list[int]:
    out = []
    for ex in task.examples(split):
        free, _ = split_free(ex.reference)
        out.append(len(free.removeprefix(OPEN).removesuffix(CLOSE).split()))
    return out


def test_each_prompt_draws_its_free_part_length_from_the_range():
    lengths = _lengths(_task([40, 80]))
    assert min(lengths) >= 40 and max(lengths) <= 80
    assert min(lengths) <= 45 and max(lengths) >= 75  # the whole range is used
    assert len(set(lengths)) > 20  # no length dominates


def test_lengths_are_fixed_by_the_seed():
    assert _lengths(_task([40, 80])) == _lengths(_task([40, 80]))
    assert _lengths(_task([40, 80])) != _lengths(_task([40, 80], seed=1))
    assert _lengths(_task([40, 80]), "val") != _lengths(_task([40, 80]), "train")[:64]


def test_a_count_keeps_one_length_and_the_same_examples_as_before():
    fixed = _task(60)
    assert set(_lengths(fixed)) == {60}
    assert fixed.examples("train") == _task([60, 60]).examples("train")


def test_the_range_changes_only_the_free_part():
    fixed, ranged = _task(60, reference_success=0.5), _task([40, 80], reference_success=0.5)
    for a, b in zip(fixed.examples("train"), ranged.examples("train"), strict=True):
        assert a.messages == b.messages and a.data == b.data
        assert split_free(a.reference)[1] == split_free(b.reference)[1]
        # the checkers read the answer only: the same rewards whatever the free part's length
        assert ranged.score(b, b.reference).rewards == fixed.score(a, a.reference).rewards


def test_references_meet_every_constraint_at_any_length():
    task = _task([0, 80], reference_success=1.0)
    scores = [task.score(ex, ex.reference) for ex in task.examples("train")]
    assert all(s.checks["success"] and s.checks["answer_part"] for s in scores)
    assert 0 in _lengths(task)  # an empty free part is still one that opens and closes


def test_the_long_toy_takes_a_range_from_the_command_line():
    from mrtpo.run.config import compose

    cfg = compose("train.yaml", ["experiment=toy_long", "task.free_tokens=[40,80]"])
    task = instantiate(cfg.task)
    assert task.free == (40, 80)
    # the preset's token budget still holds the longest free part and the answer
    assert cfg.rollout.sampling.max_new_tokens >= 80 + 6 + 12
