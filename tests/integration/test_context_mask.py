"""``method.context=mask``: ``P_\\k`` is ``P_all``'s token sequence with reward k's information
hidden from attention and every position id kept (method.md §1).

The reference is the obvious forward: the information's tokens physically removed from
``P_all``, the remaining tokens keeping their ``P_all`` position ids. The information's tokens
are found here independently of replay: by searching the rendered chat text for the
information's own text and taking every token whose characters overlap it.
"""

from __future__ import annotations

import pytest
import torch
from hydra.utils import instantiate
from tests.integration.test_replay import BlockTask, _scored

from mrtpo.core.chat import chat_ids
from mrtpo.core.credit import js_distance
from mrtpo.core.credit.methods import MRTPO, RelevanceRequest
from mrtpo.core.replay import Replayer
from mrtpo.tasks.base import Contexts
from mrtpo.tasks.instructions import InstructionTask
from mrtpo.tasks.instructions.data import TEMPLATES, render_prompt, sentence_spans
from mrtpo.tasks.synthetic.task import SyntheticTask

MASK = RelevanceRequest("per_reward", "jsd", "mask")


@pytest.fixture(scope="module")
def instructions(tmp_path_factory):
    nltk_dir = tmp_path_factory.mktemp("nltk_data")
    return InstructionTask(
        nltk_data_dir=str(nltk_dir), generator={"num_prompts": 4, "seed": 3}, max_constraints=13
    )


def _items(task, example) -> dict[str, str]:
    """Reward name -> the text of its information, as the task states it."""
    if isinstance(task, BlockTask):
        return dict(task.blocks)
    if isinstance(task, SyntheticTask):
        return {c.kind: c.sentence() for c in example.data["constraints"]}
    return {f"c{i}": c["text"] for i, c in enumerate(example.data["constraints"])}


def _hidden(tok, messages, texts: list[str]) -> set[int]:
    """P_all's tokens whose characters overlap one of ``texts`` in the rendered chat text."""
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    assert enc["input_ids"] == chat_ids(tok, messages)
    spans = []
    for item in texts:
        assert text.count(item) == 1, item  # found without ambiguity
        spans.append((text.index(item), text.index(item) + len(item)))
    return {
        i
        for i, (a, b) in enumerate(enc["offset_mapping"])
        if any(a < e and b > s for s, e in spans)
    }


def _logp(model, ids: list[int], keep: list[int], response: list[int]) -> torch.Tensor:
    """Next-token log-probs over ``response`` after ``ids[keep]``, positions as in ``ids``."""
    seq = [ids[i] for i in keep] + response
    pos = keep + list(range(len(ids), len(ids) + len(response)))
    with torch.no_grad():
        out = model(input_ids=torch.tensor([seq]), position_ids=torch.tensor([pos]))
    p = len(keep)
    return torch.log_softmax(out.logits[0, p - 1 : p - 1 + len(response)].float(), -1)


def _check_against_removed(model, tok, task, scored, res, joint: bool) -> int:
    """Every replayed pair's q equals the JSD between P_all and the removed-and-kept forward."""
    roll, checked = scored.rollout, 0
    for j in range(roll.n):
        ex, t = roll.examples[j], int(roll.response_mask[j].sum())
        ctx = task.contexts(ex, scored.scores[j])
        ids, response = chat_ids(tok, ctx.all), roll.response_ids[j, :t].tolist()
        full = _logp(model, ids, list(range(len(ids))), response)
        items = _items(task, ex)
        keys = ["joint"] if joint else list(scored.reward_names)
        for k, name in enumerate(keys):
            if not res.replayed[j, k]:
                continue
            texts = list(items.values()) if joint else [items[name]]
            hidden = _hidden(tok, ctx.all, texts)
            assert hidden, name
            keep = [i for i in range(len(ids)) if i not in hidden]
            ref = js_distance(full, _logp(model, ids, keep, response))
            torch.testing.assert_close(res.q[j, k, :t], ref, atol=2e-5, rtol=1e-4)
            checked += 1
    return checked


@pytest.mark.parametrize("shared", ["off", "always"])
@pytest.mark.parametrize("kind", ["blocks", "synthetic", "instructions"])
def test_masked_replay_equals_the_context_with_the_information_removed_positions_kept(
    tiny, instructions, one_torch_thread, kind, shared
):
    model, tok = tiny
    model.eval()
    task = {"blocks": BlockTask(), "synthetic": SyntheticTask(num_constraints=4)}.get(
        kind, instructions
    )
    scored = _scored(task, tiny)
    pairs = torch.ones(scored.rewards.shape, dtype=torch.bool)
    res = Replayer(tok, token_budget=256, jsd_chunk=5, shared_prompt=shared).run(
        model, task, scored, pairs, MASK
    )
    assert res.replayed.any()
    assert (res.stats["shared_prefix_batches"] > 0) == (shared == "always")
    assert _check_against_removed(model, tok, task, scored, res, joint=False) >= 4
    # P_all is replayed as it is: its log-probs are the plain forward's where it is P0
    rows = res.logp_rows.nonzero().flatten().tolist()
    assert bool(res.logp_rows.any()) == (kind != "blocks")
    for j in rows:
        t = int(scored.rollout.response_mask[j].sum())
        ids = chat_ids(tok, scored.rollout.examples[j].messages)
        response = scored.rollout.response_ids[j, :t].tolist()
        ref = _logp(model, ids, list(range(len(ids))), response)
        got = ref.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)
        torch.testing.assert_close(res.logp[j, :t], got, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("shared", ["off", "always"])
def test_joint_masked_replay_hides_every_item(tiny, one_torch_thread, shared):
    model, tok = tiny
    model.eval()
    task = BlockTask()
    scored = _scored(task, tiny)
    pairs = torch.ones((scored.rollout.n, 1), dtype=torch.bool)
    request = RelevanceRequest("joint", "jsd", "mask")
    res = Replayer(tok, token_budget=256, shared_prompt=shared).run(
        model, task, scored, pairs, request
    )
    assert _check_against_removed(model, tok, task, scored, res, joint=True) == scored.rollout.n


def test_mask_keeps_positions_where_delete_moves_them(tiny, one_torch_thread):
    """Removing the first block moves every later token in delete mode; in mask mode the
    same information is left out with positions kept, so the two relevances differ."""
    model, tok = tiny
    model.eval()
    task = BlockTask()
    scored = _scored(task, tiny)
    pairs = torch.ones(scored.rewards.shape, dtype=torch.bool)
    mask = Replayer(tok).run(model, task, scored, pairs, MASK)
    delete = Replayer(tok).run(model, task, scored, pairs, "per_reward")
    assert torch.equal(mask.replayed, delete.replayed)
    assert (mask.q[:, 0] - delete.q[:, 0]).abs().max() > 1e-3


class NoSpans(BlockTask):
    """A task whose own contexts do not say where the information sits."""

    def contexts(self, example, score):
        ctx = super().contexts(example, score)
        return Contexts(all=ctx.all, without=ctx.without, none=ctx.none)


def test_a_task_without_spans_is_refused_in_one_line(tiny):
    model, tok = tiny
    scored = _scored(NoSpans(), tiny)
    pairs = torch.ones(scored.rewards.shape, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"Contexts\.spans.*method\.context=delete"):
        Replayer(tok).run(model, NoSpans(), scored, pairs, MASK)


@pytest.mark.parametrize("template", TEMPLATES)
def test_constraint_sentences_are_found_in_every_template(template):
    sentences = ["Use no commas", "Answer in French.", "End with the word bye"]
    prompt = render_prompt("Describe a cat.", sentences, template)
    spans = sentence_spans(prompt, "Describe a cat.", sentences, template)
    for sentence, (a, b) in zip(sentences, spans, strict=True):
        assert prompt[a:b].rstrip(".") == sentence.rstrip(".")


def test_context_is_a_method_option_with_delete_the_default():
    from mrtpo.run.config import compose

    for name in ("mrtpo", "mrtpo_joint", "mrtpo_saw", "mrtpo_shuffle"):
        cfg = compose("train.yaml", [f"method={name}"])
        assert cfg.method.context == "delete", name
        assert instantiate(cfg.method).relevance.form == "delete"
    cfg = compose("train.yaml", ["method=mrtpo_joint", "method.context=mask"])
    method = instantiate(cfg.method)
    assert method.relevance == RelevanceRequest("joint", "jsd", "mask")
    with pytest.raises(ValueError, match=r"method\.context='hide'"):
        MRTPO(context="hide")


def test_fsdp_runs_a_masked_replay_step_that_equals_the_removed_context(tmp_path, cache_dir, tiny):
    """trainer=fsdp (2 gloo ranks, uneven work: rank 1 replays nothing): one MRTPO step with
    method.context=mask; rank 0's relevance equals the removed-and-kept reference computed
    here with the unsharded initial model (replay runs before the step's update)."""
    from tests.integration.test_fsdp import _cmd, _one_run, _run

    extra = ("trainer.max_steps=1", "method.context=mask", "rollout.sampling.temperature=1.0")
    _run(_cmd("fsdp", tmp_path, cache_dir, *extra), timeout=900)
    run = _one_run(tmp_path)
    rec = torch.load(run / "debug" / "step000000_rank0.pt", weights_only=False)
    idle = torch.load(run / "debug" / "step000000_rank1.pt", weights_only=False)
    assert rec["replayed"].any() and not idle["replayed"].any()
    model, tok = tiny
    model.eval()
    task = SyntheticTask()
    examples = {e.id: e for e in task.examples("train")}
    checked = 0
    for j, k in rec["replayed"].nonzero().tolist():
        ex, t = examples[rec["ids"][j]], int(rec["mask"][j].sum())
        ids, response = chat_ids(tok, ex.messages), rec["response_ids"][j, :t].tolist()
        name = task.reward_names[k]
        hidden = _hidden(tok, ex.messages, [_items(task, ex)[name]])
        keep = [i for i in range(len(ids)) if i not in hidden]
        full = _logp(model, ids, list(range(len(ids))), response)
        ref = js_distance(full, _logp(model, ids, keep, response))
        torch.testing.assert_close(rec["q"][j, k, :t], ref, atol=2e-5, rtol=1e-4)
        checked += 1
    assert checked >= 2


def test_attention_that_ignores_a_4d_mask_is_refused_in_one_line(tiny):
    import copy

    model, tok = tiny
    flash = copy.deepcopy(model)
    flash.config._attn_implementation = "flash_attention_2"
    scored = _scored(BlockTask(), tiny)
    pairs = torch.ones(scored.rewards.shape, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"flash_attention_2.*use method\.context=delete"):
        Replayer(tok).run(flash, BlockTask(), scored, pairs, MASK)
