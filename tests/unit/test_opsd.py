"""OPSD: the generalized JSD against direct float64 sums, the chunked form (values and
gradients), both variants' credit, the teacher context, start-up refusals and the OmniSQL
reference loader."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from tests.conftest import CONFIG_DIR

from mrtpo.core.credit import (
    OPSD,
    CreditInputs,
    TeacherScores,
    generalized_jsd,
    generalized_jsd_chunked,
    js_distance,
    sampled_token_scores,
)
from mrtpo.core.loss import aggregate
from mrtpo.tasks.base import Example, Score, Task
from mrtpo.tasks.synthetic.task import SyntheticTask
from mrtpo.tasks.text2sql.task import ReferenceSolutions, load_solutions, to_answer_format

# ---- the divergence -----------------------------------------------------------------------

P_S = [0.5, 0.25, 0.25, 0.0]
P_T = [0.7, 0.1, 0.1, 0.1]


def _direct(ps: list[float], pt: list[float], beta: float) -> float:
    """The definition, summed term by term in Python floats (float64)."""

    def kl(p, q):
        return sum(
            (a * math.log(a / b) if b > 0 else math.inf) for a, b in zip(p, q, strict=True) if a > 0
        )

    if beta == 0:
        return kl(pt, ps)
    if beta == 1:
        return kl(ps, pt)
    m = [(1 - beta) * a + beta * b for a, b in zip(ps, pt, strict=True)]
    return beta * kl(pt, m) + (1 - beta) * kl(ps, m)


def _log(p: list[float], dtype=torch.float64) -> torch.Tensor:
    return torch.tensor(p, dtype=dtype).log()


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_generalized_jsd_equals_the_float64_definition(beta):
    # the student gives 0 to a token the teacher allows: forward KL is infinite there
    for ps, pt in ((P_S, P_T), (P_T, P_S), (P_T, [0.25] * 4)):
        got = generalized_jsd(_log(ps), _log(pt), beta)
        want = _direct(ps, pt, beta)
        assert got.dtype == torch.float64
        if math.isinf(want):  # a KL end with a zero where the other side has mass
            assert math.isinf(float(got)) and float(got) > 0
        else:
            assert float(got) == pytest.approx(want, rel=1e-12, abs=0)
    # the two ends are the two KL directions (the authors' convention)
    assert float(generalized_jsd(_log(P_T), _log([0.25] * 4), 0.0)) == pytest.approx(
        sum(0.25 * math.log(0.25 / a) for a in P_T), rel=1e-12
    )
    assert float(generalized_jsd(_log(P_T), _log([0.25] * 4), 1.0)) == pytest.approx(
        sum(a * math.log(a / 0.25) for a in P_T), rel=1e-12
    )


def test_generalized_jsd_exact_small_values():
    half = _log([0.5, 0.5])
    one_hot = _log([1.0, 0.0])
    # beta 0: KL(teacher || student) = 1 * log(1 / 0.5)
    assert float(generalized_jsd(half, one_hot, 0.0)) == pytest.approx(math.log(2), abs=1e-15)
    # beta 1: KL(student || teacher) with the teacher giving 0 to a student token: infinite
    assert math.isinf(float(generalized_jsd(half, one_hot, 1.0)))
    # beta 0.5 is the ordinary JSD: ln 2 x (JS distance, base 2)^2
    a, b = _log([0.2, 0.3, 0.5]), _log([0.6, 0.3, 0.1])
    jsd = float(generalized_jsd(a, b, 0.5))
    assert jsd == pytest.approx(math.log(2) * float(js_distance(a, b)) ** 2, rel=1e-12)
    # m = (0.75, 0.25): 0.5 * log(1/0.75) + 0.5 * (0.5 log(0.5/0.75) + 0.5 log(0.5/0.25))
    want = 0.5 * math.log(1 / 0.75) + 0.5 * (0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(2))
    assert float(generalized_jsd(half, one_hot, 0.5)) == pytest.approx(want, rel=1e-14)
    # an asymmetric beta: beta KL(t || m) + (1 - beta) KL(s || m), m = 0.75 s + 0.25 t
    assert float(generalized_jsd(a, b, 0.25)) == pytest.approx(
        _direct([0.2, 0.3, 0.5], [0.6, 0.3, 0.1], 0.25), rel=1e-12
    )


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_identical_distributions_give_zero_and_float32_by_default(beta):
    lp = torch.log_softmax(torch.randn(3, 5, 11), -1)
    out = generalized_jsd(lp, lp.clone(), beta)
    assert out.dtype == torch.float32 and out.shape == (3, 5)
    assert torch.equal(out, torch.zeros_like(out))
    with pytest.raises(ValueError, match=r"method\.beta"):
        generalized_jsd(lp, lp, 1.5)


def _direct_tensor(s_logits, t_logits, beta, tau):
    ls = torch.log_softmax(s_logits.double() / tau, -1)
    lt = torch.log_softmax(t_logits.double() / tau, -1)
    return generalized_jsd(ls, lt, beta)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_chunked_matches_the_whole_computation_values_and_gradients(beta, chunk):
    g = torch.Generator().manual_seed(0)
    n, t, v = 3, 7, 13
    s_logits = torch.randn(n, t, v, generator=g, dtype=torch.float64).requires_grad_()
    t_logits = torch.randn(n, t, v, generator=g, dtype=torch.float64)
    ids = torch.randint(0, v, (n, t), generator=g)
    mask = torch.ones(n, t, dtype=torch.bool)
    mask[1, 4:] = False
    mask[2, 1:] = False
    tau = 0.7
    calls = []

    def teacher(s, e):  # the function form: called a chunk at a time
        calls.append((s, e))
        return t_logits[:, s:e]

    div, t_y, s_y, top1 = generalized_jsd_chunked(
        s_logits, teacher, mask, ids, beta=beta, temperature=tau, chunk=chunk
    )
    assert calls and all(e - s <= max(1, chunk // n) for s, e in calls)
    want = torch.where(mask, _direct_tensor(s_logits, t_logits, beta, tau), 0.0)
    torch.testing.assert_close(div.double(), want, atol=1e-5, rtol=1e-5)
    assert bool((div[~mask] == 0).all()) and not bool(top1[~mask].any())
    lt = torch.log_softmax(t_logits / tau, -1)
    ls = torch.log_softmax(s_logits.detach() / tau, -1)
    torch.testing.assert_close(
        t_y.double(),
        torch.where(mask, lt.gather(-1, ids[..., None])[..., 0], 0.0),
        atol=1e-6,
        rtol=0,
    )
    torch.testing.assert_close(
        s_y.double(),
        torch.where(mask, ls.gather(-1, ids[..., None])[..., 0], 0.0),
        atol=1e-6,
        rtol=0,
    )
    assert torch.equal(top1, (lt.argmax(-1) == ids) & mask)
    # gradients: through the checkpointed chunks as through the direct sum
    (div.sum()).backward()
    got = s_logits.grad.clone()
    s_logits.grad = None
    torch.where(mask, want, 0.0).sum().backward()
    torch.testing.assert_close(got, s_logits.grad, atol=1e-5, rtol=1e-4)


def test_sampled_token_scores_exact():
    logits = torch.tensor([[[0.0, math.log(3.0)], [math.log(3.0), 0.0], [5.0, 5.0]]])
    ids = torch.tensor([[1, 1, 0]])
    mask = torch.tensor([[True, True, False]])
    lp, top = sampled_token_scores(logits, ids, mask, temperature=1.0, chunk=1)
    torch.testing.assert_close(lp, torch.tensor([[math.log(0.75), math.log(0.25), 0.0]]))
    assert top.tolist() == [[True, False, False]]


# ---- the method ---------------------------------------------------------------------------


def _inputs(extra=None):
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    return CreditInputs(
        rewards=torch.tensor([[1.0], [0.0], [1.0]]),
        group=torch.tensor([0, 0, 1]),
        mask=mask,
        extra=extra,
    )


def test_full_variant_gives_no_reward_credit():
    m = OPSD()
    assert m.teacher.full and not m.teacher.sampled
    out = m(_inputs())
    assert torch.equal(out.advantages, torch.zeros(3, 4))


def test_sampled_variant_advantage_is_the_log_prob_gap():
    m = OPSD(variant="sampled")
    assert m.teacher.sampled and not m.teacher.full
    t_lp = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-1.0, -1.0, 0, 0], [-3.0, -3.0, -3.0, -3.0]])
    s_lp = torch.tensor([[-1.5, -1.0, -0.5, 0.0], [-2.0, -0.5, 0, 0], [-1.0, -1.0, -1.0, -1.0]])
    top1 = torch.tensor([[1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    rows = torch.tensor([True, True, False])  # the third example has no reference
    out = m(_inputs(TeacherScores(t_lp, s_lp, top1, rows)))
    want = torch.tensor([[0.5, -1.0, 0.0, 0.0], [1.0, -0.5, 0.0, 0.0], [0.0] * 4])
    assert torch.equal(out.advantages, want)
    st = out.stats
    assert st["logp_gap"] == pytest.approx((0.5 - 1.0 + 0.0 + 1.0 - 0.5) / 5)
    assert st["divergence"] == pytest.approx(-st["logp_gap"])
    assert st["teacher_agree"] == pytest.approx(2 / 5)
    assert st["teacher_share"] == pytest.approx(2 / 3)
    with pytest.raises(RuntimeError, match="variant=sampled"):
        m(_inputs())


def test_divergence_is_the_aggregated_generalized_jsd():
    g = torch.Generator().manual_seed(1)
    s_logits = torch.randn(2, 3, 5, generator=g).requires_grad_()
    t_logits = torch.randn(2, 3, 5, generator=g)
    ids = torch.randint(0, 5, (2, 3), generator=g)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    m = OPSD(beta=0.5, coef=2.0, chunk=2)
    term, st = m.divergence(s_logits, t_logits, ids, mask, 1.0, "token-mean", 10.0)
    per = generalized_jsd(torch.log_softmax(s_logits, -1), torch.log_softmax(t_logits, -1), 0.5)
    want = 2.0 * aggregate(torch.where(mask, per, 0.0), mask, "token-mean", 10.0)
    torch.testing.assert_close(term, want)
    assert st["distill/divergence"] == pytest.approx(float(per.detach()[mask].mean()), rel=1e-5)
    assert 0.0 <= st["distill/teacher_agree"] <= 1.0
    term.backward()
    assert s_logits.grad is not None and bool((s_logits.grad[0, 2] == 0).all())


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [({"variant": "topk"}, "method.variant"), ({"beta": 2}, "method.beta"),
     ({"coef": 0}, "method.coef"), ({"chunk": 0}, "method.chunk")],
)  # fmt: skip
def test_bad_settings_name_their_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        OPSD(**kwargs)


def test_config_file_instantiates_the_authors_defaults():
    m = instantiate(OmegaConf.load(CONFIG_DIR / "method" / "opsd.yaml"))
    assert isinstance(m, OPSD)
    assert (m.variant, m.jsd_beta, m.coef) == ("full", 0.5, 1.0)


# ---- the teacher context and start-up checks ----------------------------------------------


def test_teacher_context_decodes_as_question_reference_question(tiny):
    _, tok = tiny
    task = SyntheticTask(num_constraints=2)
    ex = task.examples("train")[0]
    msgs = task.teacher_messages(ex)
    user = [m for m in ex.messages if m["role"] == "user"][-1]["content"]
    assert [m["role"] for m in msgs][-3:] == ["user", "assistant", "user"]
    assert msgs[: len(ex.messages)] == ex.messages and msgs[-1]["content"] == user
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    first = text.index(user)
    ref_at = text.index(ex.reference, first + len(user))
    again = text.index(user, ref_at + len(ex.reference))
    assert first < ref_at < again
    assert text.rstrip().endswith("assistant")  # the student's answer is read after this
    # the example itself is untouched
    assert ex.messages == task.examples("train")[0].messages
    assert task.teacher_messages(Example(id="x", messages=ex.messages)) is None


class _NoReferences(Task):
    name = "no_refs"
    reward_names = ("r",)

    def examples(self, split):
        return [
            Example(id=str(i), messages=[{"role": "user", "content": f"q{i}"}]) for i in range(3)
        ]

    def score(self, example, response):
        return Score(rewards={"r": 1.0})


def test_opsd_refuses_a_task_without_references():
    with pytest.raises(ValueError, match=r"method=opsd .*task=no_refs"):
        OPSD().setup(_NoReferences())
    OPSD().setup(SyntheticTask(num_constraints=2))  # references: accepted


# ---- OmniSQL's solutions ------------------------------------------------------------------

COT = "The question asks for a count.\nSo count the singers.\n```sql\nSELECT count(*)\nFROM singer;\n```"


def test_answer_format_keeps_the_reasoning_and_the_last_sql_block():
    text = to_answer_format("Draft:\n```sql\nSELECT 1\n```\nBetter:\n```sql\nSELECT 2\n```")
    assert text == (
        "<think>\nDraft:\n```sql\nSELECT 1\n```\nBetter:\n</think>\n<answer>\n```sql\n"
        "SELECT 2\n```\n</answer>"
    )
    assert to_answer_format("no query here") is None


def test_loader_matches_questions_and_counts(tmp_path):
    rows = [
        {"db_id": "concert_singer", "question": "How many  singers are there?", "query": "q", "cot": COT},
        {"db_id": "concert_singer", "question": "how many singers are there?", "query": "q", "cot": COT},
        {"db_id": "pets", "question": "Pets?", "query": "q", "cot": "no block"},
    ]  # fmt: skip
    path = tmp_path / "train_spider_enhanced_with_cot.json"
    path.write_text(json.dumps(rows))
    _, stats = load_solutions(path)
    assert stats == {"read": 3, "kept": 1, "no_sql_block": 1, "duplicates": 1}
    refs = ReferenceSolutions(str(path))
    got = refs.reference("concert_singer", "How many singers are there?", "gold text")
    assert got.startswith("<think>\nThe question asks") and "SELECT count(*)\nFROM singer;" in got
    assert refs.reference("concert_singer", "Another question?", "gold") is None
    assert ReferenceSolutions("gold").reference("x", "y", "gold text") == "gold text"
    with pytest.raises(ValueError, match=r"task\.reference_solutions is not set"):
        ReferenceSolutions(None).reference("x", "y", "gold")
    with pytest.raises(FileNotFoundError, match=r"task\.reference_solutions"):
        ReferenceSolutions(str(tmp_path / "absent.json")).reference("x", "y", None)
    path.write_text(json.dumps([{"input_seq": "...", "output_seq": "..."}]))
    with pytest.raises(ValueError, match="lacks db_id/question/cot"):
        load_solutions(path)
