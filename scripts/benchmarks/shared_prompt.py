"""The shared-prompt forward against the plain one (docs/scaling.md's tables):

    python scripts/benchmarks/shared_prompt.py            # the doc's cases
    python scripts/benchmarks/shared_prompt.py --quick    # one small case (the test's)

Forward + backward of ``response_logprobs`` on random Qwen2 models, fp32, one torch thread,
8 rows sharing one prompt with 64-token responses: the plain forward and the two shared forms,
the key/value-cache form (no gradient checkpointing) and the packed form (gradient
checkpointing while training, where the cache form is off). Median of ``--repeats`` runs taken
in turn, so that a loaded machine slows every case alike.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from mrtpo.core.forward import pad_left, pad_right, prompt_groups, response_logprobs

#: name -> (hidden size, layers, MLP size)
MODELS = {"h64, 2 layers": (64, 2, 128), "h256, 4 layers": (256, 4, 512)}
PROMPTS = (512, 128)
ROWS, RESPONSE = 8, 64


def _model(hidden: int, layers: int, inter: int) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=1000, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    model = Qwen2ForCausalLM(cfg).float()
    model.set_attn_implementation("sdpa")
    return model.train()


def _timed(model, batch, mode: str) -> float:
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    response_logprobs(model, *batch, shared_prompt=mode).sum().backward()
    return time.perf_counter() - t0


def measure(shape: tuple[int, int, int], prompt: int, repeats: int) -> dict[str, float]:
    """Median milliseconds per case for one model shape and prompt length."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(5, 1000, (prompt,), generator=g).tolist()
    p_ids, p_mask = pad_left([tokens] * ROWS, 0)
    r_ids, r_mask = pad_right(
        [torch.randint(5, 1000, (RESPONSE,), generator=g).tolist() for _ in range(ROWS)], 0
    )
    batch = (p_ids, p_mask, r_ids, r_mask)
    plain = _model(*shape)
    ckpt = copy.deepcopy(plain)
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    groups = prompt_groups(ckpt, p_ids, p_mask, RESPONSE, "always", packable=True)
    assert groups is not None and groups.packed  # checkpointed and training: the packed form
    cases = {
        "plain": (plain, "off"),
        "cache": (plain, "always"),
        "plain, checkpointed": (ckpt, "off"),
        "packed, checkpointed": (ckpt, "always"),
    }
    times: dict[str, list[float]] = {k: [] for k in cases}
    for model, mode in cases.values():  # warm-up
        _timed(model, batch, mode)
    for _ in range(repeats):
        for name, (model, mode) in cases.items():
            times[name].append(_timed(model, batch, mode))
    return {k: 1000 * statistics.median(v) for k, v in times.items()}


def table(rows: list[tuple[str, int, dict[str, float]]]) -> str:
    out = [
        "| model | prompt | plain | cache form | ratio | plain, checkpointed | packed form | ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, prompt, ms in rows:
        a, b = ms["plain"], ms["cache"]
        c, d = ms["plain, checkpointed"], ms["packed, checkpointed"]
        out.append(
            f"| {name} | {prompt} | {a:,.0f} ms | {b:,.0f} ms | {b / a:.2f} "
            f"| {c:,.0f} ms | {d:,.0f} ms | {d / c:.2f} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one small case, 1 repeat")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    models = dict(list(MODELS.items())[:1]) if a.quick else MODELS
    prompts = PROMPTS[-1:] if a.quick else PROMPTS
    repeats = 1 if a.quick else a.repeats
    rows = [(n, p, measure(s, p, repeats)) for n, s in models.items() for p in prompts]
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
