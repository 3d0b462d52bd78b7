"""InstructionTask: reward slots, scores, summaries, splits and configuration errors."""

from __future__ import annotations

import math

import pytest

from mrtpo.tasks.base import Example, Score
from mrtpo.tasks.instructions import InstructionTask
from mrtpo.tasks.instructions.judge import JudgeError, RubricJudge, parse_verdicts


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> InstructionTask:
    nltk_dir = tmp_path_factory.mktemp("nltk_data")
    return InstructionTask(
        nltk_data_dir=str(nltk_dir), generator={"num_prompts": 24, "seed": 5}, max_constraints=13
    )


def test_reward_slots_vary_per_prompt(task):
    assert task.reward_names == tuple(f"c{i}" for i in range(13))
    assert task.rewards_vary_per_prompt
    small = InstructionTask(max_constraints=4, generator={"max_constraints": 4})
    assert small.reward_names == ("c0", "c1", "c2", "c3")


def test_slots_have_names_a_person_reads_and_stable_keys(task):
    """Tables show "constraint 1".."constraint 13"; the keys (metrics.csv, checkpoints'
    reward_names, reports) stay c0..c12. success is the all-constraints rate."""
    assert task.reward_labels == {f"c{i}": f"constraint {i + 1}" for i in range(13)}
    assert list(task.reward_labels) == list(task.reward_names)
    assert task.success_check == "prompt_strict"
    ex = task.examples("train")[0]
    n = len(ex.data["constraints"])
    score = task.score(ex, "a short reply, with a comma.")
    assert score.checks["prompt_strict"] == all(score.rewards[f"c{i}"] == 1.0 for i in range(n))


def test_scores_fill_one_slot_per_constraint_and_pad_with_none(task):
    for ex in task.examples("train")[:8]:
        n = len(ex.data["constraints"])
        score = task.safe_score(ex, "a short reply, with a comma.")
        assert score.error is None
        assert score.blocks == {}  # the information is in the prompt, not in blocks
        assert all(score.rewards[f"c{i}"] in (0.0, 1.0) for i in range(n))
        assert all(score.rewards[f"c{i}"] is None for i in range(n, 13))
        assert len(score.checks["strict"]) == n
        assert "loose" not in score.checks  # training prompts: strict only
        for i in range(n):
            failed = score.rewards[f"c{i}"] == 0.0
            assert (f"c{i}" in score.reasons) == failed
            if failed:
                assert score.reasons[f"c{i}"].startswith(ex.data["constraints"][i]["id"])


def test_prompt_that_is_followed_scores_all_ones(task):
    ex = Example(
        id="x",
        messages=[{"role": "user", "content": "Say hi. Use no commas. Wrap it in quotes."}],
        data={
            "split": "custom",
            "registry": "ifeval",
            "base": "Say hi.",
            "template": "type6",
            "prompt": "Say hi.",
            "constraints": [
                {"id": "punctuation:no_comma", "kwargs": {}, "text": "Use no commas."},
                {"id": "startend:quotation", "kwargs": {}, "text": "Wrap it in quotes."},
            ],
            "eval": True,
        },
    )
    good = task.score(ex, '"hi there"')
    assert (good.rewards["c0"], good.rewards["c1"]) == (1.0, 1.0)
    assert good.checks["prompt_strict"] and good.checks["prompt_loose"]
    bad = task.score(ex, "hi, there")
    assert (bad.rewards["c0"], bad.rewards["c1"]) == (0.0, 0.0)
    assert bad.reasons["c1"] == "startend:quotation: not followed"


def _score(strict, loose=None):
    checks = {"instruction_ids": ["a:x", "b:y", "a:x"][: len(strict)], "strict": strict}
    if loose is not None:
        checks["loose"] = loose
    return Score(rewards={}, checks=checks)


def test_summarize_averages_over_every_scored_line(task):
    ex = [Example(id=i, messages=[], data={"split": "t"}) for i in ("p", "p", "q")]
    scores = [
        _score([True, True], [True, True]),
        _score([True, False], [True, True]),  # second sample of the same prompt
        _score([False, False, True], [False, True, True]),
    ]
    m = task.summarize(ex, scores)
    assert m["n_prompts"] == 2 and m["n_scored"] == 3
    assert m["prompt_level_strict_acc"] == pytest.approx(1 / 3)
    assert m["inst_level_strict_acc"] == pytest.approx(4 / 7)
    assert m["prompt_level_loose_acc"] == pytest.approx(2 / 3)
    assert m["inst_level_loose_acc"] == pytest.approx(6 / 7)
    assert m["inst_strict/a:x"] == pytest.approx(3 / 4)
    assert m["inst_strict/b:y"] == pytest.approx(1 / 3)
    # a scoring error is left out (and counted by evaluate_examples), never counted as 0
    err = Score(rewards={}, error="boom")
    m2 = task.summarize([*ex, ex[0]], [*scores, err])
    assert m2["prompt_level_strict_acc"] == m["prompt_level_strict_acc"]
    assert not any(isinstance(v, float) and math.isnan(v) for v in m2.values())


def test_unsupported_and_unknown_splits_are_clear_errors(task, tmp_path):
    no_checkers = InstructionTask(
        nltk_data_dir=task.nltk_data_dir, muldimif={"checker_dir": str(tmp_path / "none")}
    )
    with pytest.raises(RuntimeError, match=r"task\.muldimif\.checker_dir"):
        no_checkers.examples("muldimif")
    with pytest.raises(ValueError, match="unknown split"):
        task.examples("nope")
    with pytest.raises(ValueError, match=r"task\.data\.path"):
        task.examples("hir")


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match=r"task\.generator\.max_constraints"):
        InstructionTask(max_constraints=8)  # generator still asks for up to 13
    with pytest.raises(ValueError, match=r"task\.unavailable_checkers"):
        InstructionTask(unavailable_checkers="maybe")
    with pytest.raises(ValueError, match=r"task\.val_split"):
        InstructionTask(val_split="train").examples("val")


def test_advancedif_needs_a_judge_url(task):
    with pytest.raises(ValueError, match=r"eval\.judge_url"):
        task.eval_examples("advancedif", {"split": "advancedif", "judge_url": None})


def test_judge_reply_parsing():
    assert parse_verdicts('{"verdicts": [true, false]}', 2) == [True, False]
    assert parse_verdicts('Here you go:\n```json\n{"verdicts": [true]}\n```', 1) == [True]
    assert parse_verdicts("[false, false, true]", 3) == [False, False, True]
    with pytest.raises(JudgeError):
        parse_verdicts('{"verdicts": [true]}', 2)
    with pytest.raises(JudgeError):
        parse_verdicts("yes", 1)


def test_judge_request_shape():
    judge = RubricJudge(url="http://judge:8000/v1/", model="m")
    assert judge.endpoint == "http://judge:8000/v1/chat/completions"
    body = judge.request_body([{"role": "user", "content": "Hi"}], "Hello", ["Greets", "Short"])
    assert body["model"] == "m"
    assert "1. Greets\n2. Short" in body["messages"][1]["content"]


def test_advancedif_is_scored_by_a_judge_endpoint(tmp_path, task):
    """A loopback OpenAI-compatible stub: the client's request and the rubric rewards."""
    import csv
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    seen: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append({"path": self.path, "body": body})
            reply = {"choices": [{"message": {"content": '{"verdicts": [true, false]}'}}]}
            data = json.dumps(reply).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        path = tmp_path / "advancedif.csv"
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["conversation_history", "prompt_metadata"])
            w.writeheader()
            convo = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
            meta = {"rubrics": ["Greets the user", "Uses exactly three words"]}
            w.writerow(
                {"conversation_history": json.dumps(convo), "prompt_metadata": json.dumps(meta)}
            )
        t = InstructionTask(nltk_data_dir=task.nltk_data_dir, eval_files={"advancedif": str(path)})
        url = f"http://127.0.0.1:{server.server_port}/v1"
        examples = t.eval_examples("advancedif", {"judge_url": url, "judge_model": "judge-m"})
        score = t.safe_score(examples[0], "Hello there!")
        assert score.error is None
        assert (score.rewards["c0"], score.rewards["c1"], score.rewards["c2"]) == (1.0, 0.0, None)
        assert seen[0]["path"] == "/v1/chat/completions" and seen[0]["body"]["model"] == "judge-m"
        assert "[system]\nBe terse." in seen[0]["body"]["messages"][1]["content"]
        m = t.summarize(examples, [score])
        assert m["prompt_level_strict_acc"] == 0.0 and m["inst_level_strict_acc"] == 0.5
        assert not any(k.startswith("inst_strict/") for k in m)
    finally:
        server.shutdown()
