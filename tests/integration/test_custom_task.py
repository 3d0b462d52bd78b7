"""``task=custom``: a user's JSONL and reward functions train on the tiny model, MRTPO's
replay uses the user's verifier blocks, and bad input is named before anything runs."""

from __future__ import annotations

import csv
import hashlib
import json
import math
import sys
import textwrap

import pytest
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from tests.conftest import CONFIG_DIR

from mrtpo.lightning.pipeline import build, metrics_csv
from mrtpo.tasks.base import Example

MODULE = "mrtpo_test_user_rewards"

REWARDS_PY = '''
"""A user's reward module, as TRL users write them: (prompt, response, **row)."""

CALLS = {"block": 0}


def even_length(prompt, response, **row):
    # varies between samples of one prompt, so replay has pairs to score
    return float(len(response) % 2 == 0)


def mentions(prompt, response, word, skip=False, **row):
    if skip:
        return None  # does not apply to this row
    return float(word in response)


def even_length_block(prompt, response, **row):
    CALLS["block"] += 1
    parity = "even" if len(response) % 2 == 0 else "odd"
    return f"Checker: the length must be even; this response has an {parity} length."


def broken(prompt, response, **row):
    raise KeyError("no_such_column")


def exits_on_odd(prompt, response, **row):
    if len(response) % 2:
        raise SystemExit(0)  # a user's sys.exit() inside a reward
    return 1.0


def interrupts(prompt, response, **row):
    raise KeyboardInterrupt
'''

ROWS = [
    {"id": "a", "prompt": "Say something short.", "word": "yes"},
    {"id": "b", "prompt": "Reply with one word.", "word": "no", "skip": True},
    {
        "id": "c",
        "prompt": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Answer briefly."},
        ],
        "word": "ok",
    },
    {"id": "d", "prompt": "Write a few letters.", "word": "a"},
]


@pytest.fixture
def user(tmp_path, monkeypatch):
    """A user's folder: prompts.jsonl and an importable module of reward functions."""
    folder = tmp_path / "user"
    folder.mkdir()
    (folder / f"{MODULE}.py").write_text(textwrap.dedent(REWARDS_PY))
    data = folder / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(sys.modules, MODULE, raising=False)
    return folder


def custom(user, *more: str, blocks: str = f"{{even_length: {MODULE}.even_length_block}}"):
    return [
        "task=custom",
        f"task.data.path={user / 'prompts.jsonl'}",
        f"task.rewards=[{MODULE}.even_length,{MODULE}.mentions]",
        f"task.blocks={blocks}",
        "task.data.id_column=id",
        *more,
    ]


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def rows_of(trainer) -> list[dict[str, str]]:
    with open(metrics_csv(trainer)) as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("method", ["mrtpo", "gdpo"])
def test_trains_two_steps_with_user_rewards(method, user, train_cfg, tmp_path):
    before = digest(user / "prompts.jsonl")
    warm = ["method.beta_warmup_steps=0"] if method == "mrtpo" else []  # replay from step 0
    cfg = train_cfg(*custom(user, f"method={method}", "rl.group_size=4", *warm))
    trainer, module, dm = build(cfg)
    assert module.task.reward_names == ("even_length", "mentions")
    trainer.fit(module, datamodule=dm)
    assert module.iteration == 2

    rows = rows_of(trainer)
    assert [r["step"] for r in rows] == ["0", "1"]
    for name in ("even_length", "mentions"):
        col = f"train/reward/{name}/mean"
        assert col in rows[0], sorted(rows[0])
        vals = [float(r[col]) for r in rows if r[col] != ""]
        assert vals and all(0.0 <= v <= 1.0 for v in vals)
    assert digest(user / "prompts.jsonl") == before  # the user's data is only read

    share = [float(r["train/replay/share"]) for r in rows if r.get("train/replay/share")]
    if method == "gdpo":
        assert not share or all(math.isnan(s) for s in share)  # GDPO never replays
        return
    # MRTPO replayed pairs, and only for the reward that has a block function.
    assert max(share) > 0, share
    dump = tmp_path / "relevance.jsonl"  # in the run folder itself, as the README says
    recs = [json.loads(line) for line in dump.read_text().splitlines()]
    assert recs, "no relevance records"
    replayed = {k for r in recs for k in r["q"]}
    assert replayed == {"even_length"}, replayed
    assert sys.modules[MODULE].CALLS["block"] > 0


def test_run_folder_is_named_after_the_task(user, train_cfg):
    cfg = train_cfg(*custom(user, "method=mrtpo"))
    assert cfg.run_name == "custom-mrtpo"


def test_score_passes_row_columns_and_none(user, train_cfg):
    task = instantiate(train_cfg(*custom(user)).task)
    ex = {e.id: e for e in task.examples("train")}
    assert ex["c"].messages[0] == {"role": "system", "content": "You are terse."}
    s = task.score(ex["a"], "yes!")
    assert s.rewards == {"even_length": 1.0, "mentions": 1.0}
    assert s.blocks["even_length"].startswith("Checker:") and s.blocks["mentions"] is None
    skipped = task.score(ex["b"], "no")
    assert skipped.rewards["mentions"] is None  # the function said "does not apply"
    ctx = task.contexts(ex["a"], s)
    assert ctx.all[-1]["content"].endswith(s.blocks["even_length"])
    assert ctx.without["even_length"] == ex["a"].messages
    assert set(ctx.without) == {"even_length"}


def test_raising_reward_costs_only_its_value_and_is_named(user, train_cfg):
    cfg = train_cfg(
        *custom(user, blocks="null"), f"task.rewards=[{MODULE}.even_length,{MODULE}.broken]"
    )
    task = instantiate(cfg.task)
    s = task.safe_score(task.examples("train")[0], "abcd")
    assert s.rewards == {"even_length": 1.0, "broken": None}
    assert f"{MODULE}.broken" in s.error and "KeyError" in s.error


def test_system_exit_in_a_reward_does_not_end_the_run(user, train_cfg):
    """Issue 25 item 7: sys.exit(0) in a reward ended fit() with rc 0 after no step."""
    cfg = train_cfg(
        *custom(user, blocks="null"),
        f"task.rewards=[{MODULE}.even_length,{MODULE}.exits_on_odd]",
        "rl.group_size=4",
    )
    trainer, module, dm = build(cfg)
    trainer.fit(module, datamodule=dm)
    assert module.iteration == 2
    rows = rows_of(trainer)
    errors = [float(r["train/scoring_errors"]) for r in rows]
    assert sum(errors) > 0  # the exits were counted as scoring errors (odd lengths occur)
    assert module.fault_tracker.counters["scoring_errors_total"] == sum(errors)


@pytest.mark.slow  # a full `python src/train.py` (about a minute here)
def test_keyboard_interrupt_in_a_reward_stops_the_run_naming_it(user, tmp_path, cache_dir):
    """Issue 25 item 7: a KeyboardInterrupt from a reward gave rc 1 and no message."""
    import os
    import subprocess

    from tests.conftest import ROOT, SHARED_DATA

    args = [
        *custom(user, blocks="null"),
        f"task.rewards=[{MODULE}.even_length,{MODULE}.interrupts]",
        f"paths.log_dir={tmp_path}/logs",
        f"paths.cache_dir={cache_dir}",
        f"paths.data_dir={SHARED_DATA}",
        "trainer.max_steps=2",
        "rl.prompts_per_step=2",
        "rl.group_size=2",
        "rollout.sampling.max_new_tokens=4",
        "callbacks.progress=null",
    ]
    path = [str(user), str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    out = subprocess.run(
        [sys.executable, "src/train.py", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,  # a hang guard only
    )
    said = out.stdout + out.stderr
    assert out.returncode != 0, said[-2000:]
    want = f"KeyboardInterrupt while reward interrupts ({MODULE}.interrupts) scored example"
    assert want in said, said[-3000:]


def test_success_rule_and_names(user, train_cfg):
    cfg = train_cfg(
        *custom(
            user,
            "task.success=all",
            "task.reward_names=[parity,word]",
            blocks=f"{{parity: {MODULE}.even_length_block}}",
        )
    )
    task = instantiate(cfg.task)
    assert task.reward_names == ("parity", "word") and task.success_check == "success"
    ex = task.examples("train")[1]  # 'word' does not apply to this row
    assert task.score(ex, "ab").checks["success"] is True
    assert task.score(ex, "abc").checks["success"] is False
    metrics = task.summarize([ex, ex], [task.score(ex, "ab"), task.score(ex, "abc")])
    assert metrics["success"] == 0.5


def test_sft_references_and_val_split(user, train_cfg, tmp_path):
    data = tmp_path / "sft.jsonl"
    data.write_text(
        "".join(
            json.dumps({"q": f"Say {w}.", "a": w, "word": w, "prompt": "-", "response": "-"}) + "\n"
            for w in "xyzw"
        )
    )
    cfg = train_cfg(
        *custom(user),
        f"task.data.path={data}",
        "task.data.prompt_column=q",
        "task.data.reference_column=a",
        "task.data.id_column=null",
        "task.data.val_size=1",
    )
    task = instantiate(cfg.task)
    train, val = task.examples("train"), task.examples("val")
    assert [e.reference for e in train] == ["x", "y", "z"] and val[0].reference == "w"
    assert [e.id for e in train] == ["train-0", "train-1", "train-2"]
    # columns named like the positional arguments are not passed again as keywords
    assert task.score(train[0], "x").rewards["mentions"] == 1.0
    assert "prompt" not in train[0].data["row"] and "response" not in train[0].data["row"]
    with pytest.raises(ValueError, match=r"task\.data\.splits\.test"):
        task.examples("test")


def test_parquet_and_saved_hf_dataset(user, train_cfg, tmp_path):
    import datasets

    ds = datasets.Dataset.from_list([{"text": "Hi.", "word": "hi"}, {"text": "Yo.", "word": "yo"}])
    pq = tmp_path / "p.parquet"
    ds.to_parquet(str(pq))
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": ds, "validation": ds}).save_to_disk(str(saved))
    for path, extra in ((pq, []), (saved, ["+task.data.splits.val=validation"])):
        cfg = train_cfg(
            *custom(user), f"task.data.path={path}", "task.data.prompt_column=text", *extra
        )
        cfg.task.data.id_column = None
        task = instantiate(cfg.task)
        assert [e.messages[-1]["content"] for e in task.examples("train")] == ["Hi.", "Yo."]
        assert task.score(task.examples("train")[0], "hi").rewards["mentions"] == 1.0
        if extra:
            assert len(task.examples("val")) == 2


def test_unimportable_reward_names_the_key_and_string(user, train_cfg):
    cfg = train_cfg(*custom(user), f"task.rewards=[{MODULE}.even_length,nosuchmod.r1]")
    with pytest.raises(InstantiationException) as err:  # Hydra wraps the ImportError
        instantiate(cfg.task)
    msg = str(err.value)
    assert "task.rewards[1]" in msg and "nosuchmod.r1" in msg

    cfg = train_cfg(*custom(user, blocks="null"), f"task.rewards=[{MODULE}.no_such_fn]")
    with pytest.raises(
        InstantiationException, match=r"task\.rewards\[0\].*no attribute 'no_such_fn'"
    ):
        instantiate(cfg.task)


def test_missing_prompt_column_lists_the_columns(user, train_cfg):
    cfg = train_cfg(*custom(user), "task.data.prompt_column=question")
    with pytest.raises(InstantiationException) as err:
        instantiate(cfg.task)
    msg = str(err.value)
    assert "task.data.prompt_column='question'" in msg
    assert "['id', 'prompt', 'word', 'skip']" in msg


def test_block_for_unknown_reward_is_named(user, train_cfg):
    cfg = train_cfg(*custom(user, blocks=f"{{evenlength: {MODULE}.even_length_block}}"))
    with pytest.raises(InstantiationException, match=r"task\.blocks.*evenlength.*even_length"):
        instantiate(cfg.task)


def test_python_api_takes_callables(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "Hi"}) + "\n")

    def longish(prompt, response, **row):
        return len(response) > 3

    from mrtpo.tasks.custom import CustomTask

    task = CustomTask(data={"path": str(data)}, rewards=[longish])
    ex: Example = task.examples("train")[0]
    assert task.score(ex, "hello").rewards == {"longish": 1.0}
    with pytest.raises(ValueError, match=r"task\.reward_names"):
        CustomTask(data={"path": str(data)}, rewards=[lambda p, r, **k: 1.0])


METHODS = sorted(p.stem for p in (CONFIG_DIR / "method").glob("*.yaml"))


@pytest.mark.parametrize("method", METHODS)
def test_composes_with_every_method(method, user, train_cfg):
    cfg = train_cfg(*custom(user, f"method={method}"))
    task = instantiate(cfg.task)
    if method in ("cort", "opsd"):  # the task has no rubric in its prompts, no references
        with pytest.raises(ValueError, match=f"method={method}"):
            instantiate(cfg.method).setup(task)
        return
    instantiate(cfg.method).setup(task)
