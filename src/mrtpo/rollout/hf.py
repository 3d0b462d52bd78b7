"""Rollouts with Hugging Face ``generate``: the CPU / test engine.

It generates with the training model itself (``sync_weights`` has nothing to do) or, with
``own_copy``, from a frozen copy that ``sync_weights`` refreshes, which may generate in a
worker thread while the trainer updates. Only ``rollout.sampling`` decides how tokens are
drawn (docs/rollout.md, "No hidden generation defaults"). With several ranks every rank makes
as many ``generate`` calls as the busiest one, with ``synced_gpus=True``, and under FSDP the
ranks agree call by call on the shared prefill (``_prefilled``'s ``agree``): the samples are
those a lone rank would draw (docs/scaling.md). Each sampled token's log-prob is recorded from
the raw logits, ``log_softmax(z / temperature)``, the distribution sampled from.
"""

from __future__ import annotations

import copy
import logging

import torch

from mrtpo.core.faults import NonFiniteLogitsError
from mrtpo.core.forward import pad_left, shared_prompt_mode
from mrtpo.distributed import Ranks
from mrtpo.rollout.base import Generation, RolloutEngine, SamplingConfig

log = logging.getLogger(__name__)

# generation_config fields that change which tokens generate() draws (greedy or sampled)
SAMPLING_FIELDS = (
    "do_sample",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "top_h",
    "typical_p",
    "epsilon_cutoff",
    "eta_cutoff",
    "repetition_penalty",
    "encoder_repetition_penalty",
    "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size",
    "min_length",
    "min_new_tokens",
    "max_length",
    "max_new_tokens",
    "bad_words_ids",
    "suppress_tokens",
    "begin_suppress_tokens",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "sequence_bias",
    "exponential_decay_length_penalty",
    "num_beams",
    "num_beam_groups",
    "diversity_penalty",
    "length_penalty",
    "penalty_alpha",
    "guidance_scale",
    "renormalize_logits",
    "watermarking_config",
    "num_return_sequences",
)


def generation_config(sampling: SamplingConfig, eos_ids, pad_id):
    """A complete ``GenerationConfig`` for ``sampling``: every processor that changes the
    distribution is off unless the sampling description asks for it."""
    from transformers import GenerationConfig

    sample = not sampling.greedy and sampling.temperature > 0
    kwargs = dict(
        do_sample=sample,
        num_beams=1,
        num_return_sequences=1,
        max_new_tokens=int(sampling.max_new_tokens),
        min_length=0,
        repetition_penalty=1.0,
        encoder_repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        encoder_no_repeat_ngram_size=0,
        length_penalty=1.0,
        diversity_penalty=0.0,
        renormalize_logits=False,
        eos_token_id=list(eos_ids),
        pad_token_id=pad_id,
        use_cache=True,
    )
    if sample:
        kwargs.update(
            temperature=float(sampling.temperature),
            top_p=float(sampling.top_p),
            top_k=int(sampling.top_k),
            typical_p=1.0,
            epsilon_cutoff=0.0,
            eta_cutoff=0.0,
        )
        if sampling.min_p > 0:
            kwargs["min_p"] = float(sampling.min_p)
    return GenerationConfig(**kwargs)


def overridden_defaults(model, config) -> dict:
    """The checkpoint's ``generation_config`` settings that would change sampling and that
    ``config`` (the one generate() gets) does not share: ``{field: checkpoint value}``."""
    own = getattr(model, "generation_config", None)
    if own is None:
        return {}
    theirs, ours = own.to_dict(), config.to_dict()
    return {
        k: theirs[k]
        for k in SAMPLING_FIELDS
        if theirs.get(k) is not None and theirs.get(k) != ours.get(k)
    }


class _SampledLogprobs:
    """A logits processor that records ``log_softmax(z / temperature)`` of each sampled token.

    Custom processors run before the sampling warpers, so ``scores`` are the step's raw
    logits. Step ``t``'s token is known at step ``t + 1`` only: one step's log-softmax is kept.
    """

    def __init__(self, temperature: float) -> None:
        self.temperature = float(temperature)
        self.prev: torch.Tensor | None = None  # [rows, V] log-probs of the previous step
        self.steps: list[torch.Tensor] = []  # [rows] per step

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.take(input_ids[:, -1])
        z = scores.float()
        if self.temperature != 1.0:
            z = z / self.temperature
        self.prev = torch.log_softmax(z, dim=-1)
        return scores

    def take(self, tokens: torch.Tensor) -> None:
        if self.prev is not None:
            self.steps.append(self.prev.gather(-1, tokens[:, None].to(self.prev.device))[:, 0])
            self.prev = None

    def table(self) -> torch.Tensor:
        """[rows, steps] on the CPU."""
        return torch.stack(self.steps, dim=1).cpu() if self.steps else torch.zeros((0, 0))


class _FiniteLogits:
    """A logits processor that refuses to draw from NaN or infinite logits.

    A step whose tempered logits hold NaN or +inf, or a row with no finite logit, sets ``bad``
    and becomes one that ends every row: ``generate`` finishes at once, in step with other
    ranks, and ``HFEngine.generate`` raises ``NonFiniteLogitsError`` (not
    ``torch.multinomial``'s message, which names no setting). One flag per step is read back
    (``generate`` already synchronizes every step for its stopping criteria).
    """

    def __init__(self, temperature: float, eos_id: int) -> None:
        self.temperature = float(temperature) if temperature > 0 else 1.0
        self.eos_id = int(eos_id)
        self.bad = False

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        z = scores.float() / self.temperature if self.temperature != 1.0 else scores
        ok = (~torch.isnan(z) & ~torch.isposinf(z)).all(-1) & torch.isfinite(z).any(-1)
        if bool(ok.all()):
            return scores
        self.bad = True
        end = torch.full_like(scores, float("-inf"))
        end[:, self.eos_id] = 0.0
        return end


class HFEngine(RolloutEngine):
    """Batched sampling with ``model.generate`` (left padding, stop at EOS)."""

    def __init__(
        self, batch_size: int = 64, share_prompt: str | bool = "auto", own_copy: bool = False
    ) -> None:
        mode = shared_prompt_mode(share_prompt)
        if mode is None:
            raise ValueError(
                f"rl.shared_prompt_forward={share_prompt!r}: use auto, false or always"
            )
        self.batch_size = batch_size  # prompts x samples per generate call
        # "auto": the G samples of a prompt prefill it once (forward.prompt_groups' rules)
        self.share_prompt = mode
        self.model = self.tokenizer = None
        self.eos_ids: list[int] = []
        # the checkpoint's generation settings that sampling does not use (warned once)
        self.overridden: dict = {}
        self._warned = False
        self.own_copy = self.generates_apart = bool(own_copy)

    def bind(self, model, tokenizer, eos_ids: list[int]) -> None:
        self.tokenizer, self.eos_ids = tokenizer, list(eos_ids)
        self._warned = False
        if not self.own_copy:
            self.model = model
            return
        from mrtpo.distributed import is_sharded

        if is_sharded(model):
            raise ValueError(
                "rollout.engine.own_copy=true runs on one process or DDP (a sharded copy's "
                "generate joins collectives): use rollout=vllm_server with FSDP"
            )
        self.model = copy.deepcopy(model).requires_grad_(False)

    def sync_weights(self, model: torch.nn.Module) -> None:
        if not self.own_copy:
            self.model = model  # same parameters: nothing to copy
            return
        self.model.load_state_dict(model.state_dict())  # copied in place, under no_grad

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], n: int, sampling: SamplingConfig, seed: int
    ) -> list[Generation]:
        if self.model is None:
            raise RuntimeError("HFEngine.bind(model, tokenizer, eos_ids) must be called first")
        from transformers import GenerationConfig

        model, pad = self.model, self.tokenizer.pad_token_id
        device = next(model.parameters()).device
        flat = [p for p in prompts for _ in range(n)]
        config = generation_config(sampling, self.eos_ids, pad)
        self._warn_overridden_once(model, config)
        end = self.eos_ids[0] if self.eos_ids else (pad if pad is not None else 0)
        guard = _FiniteLogits(sampling.temperature if config.do_sample else 0.0, end)
        was_training = model.training
        own_config = getattr(model, "generation_config", None)
        model.eval()
        ranks = Ranks(lambda: device)
        # The own copy (a plain module, not sharded) generates in a worker thread beside the
        # step's collectives: it joins none, each rank on its own; the shared model keeps
        # the ranks in step (under FSDP its forwards are collectives).
        joint = not self.own_copy
        lockstep = ranks.world_size > 1 and joint
        calls = -(-len(flat) // self.batch_size)
        idle = ranks.max(calls) - calls if lockstep else 0
        agree = self._agreement(ranks, n) if joint else None
        try:
            # transformers fills unset fields from model.generation_config: leave it nothing
            model.generation_config = GenerationConfig()
            self._idle_calls(idle, config, guard, agree)
            out = self._sample(flat, n, (sampling, config, seed), guard, agree, lockstep)
        finally:
            if own_config is not None:
                model.generation_config = own_config
            model.train(was_training)
        # decided jointly where the ranks generate in step (a rank that raised alone would
        # leave the others in a collective); the own copy's rank raises alone
        if ranks.any(guard.bad) if joint else guard.bad:
            raise NonFiniteLogitsError()
        return out

    def _agreement(self, ranks: Ranks, n: int):
        """Under FSDP a shared prefill's prefix call is a collective: the ranks agree on each
        generate call (every rank shares it or none does; an idle call never shares). Returns
        ``agree(want) -> bool``, or None where no agreement is needed."""
        if ranks.world_size <= 1 or n < 2 or self.share_prompt == "off":
            return None
        from mrtpo.distributed import is_sharded

        if not is_sharded(self.model):
            return None
        return lambda want: not ranks.any(not want)

    def _idle_calls(self, idle: int, config, guard: _FiniteLogits, agree) -> None:
        """``idle`` one-token generate calls that keep this rank in step with busier ranks
        (their output is discarded)."""
        pad = self.tokenizer.pad_token_id
        device = next(self.model.parameters()).device
        for _ in range(idle):
            if agree is not None:
                agree(False)
            self.model.generate(
                input_ids=torch.full((1, 1), pad, dtype=torch.long, device=device),
                attention_mask=torch.ones((1, 1), dtype=torch.long, device=device),
                generation_config=config,
                logits_processor=[guard],
                synced_gpus=True,
            )

    def _sample(self, flat: list[list[int]], n: int, how: tuple, guard: _FiniteLogits, agree,
                lockstep: bool) -> list[Generation]:  # fmt: skip
        """The generations of the rows ``flat`` (each prompt ``n`` times), ``batch_size`` rows
        a generate call; ``how``: (sampling, its generation config, seed)."""
        sampling, config, seed = how
        pad = self.tokenizer.pad_token_id
        device = next(self.model.parameters()).device
        gen = torch.Generator(device="cpu").manual_seed(seed)
        # Log-probs of a truncated sampler are not softmax(z / t): none are reported.
        record = config.do_sample and not sampling.truncated
        out: list[Generation] = []
        for start in range(0, len(flat), self.batch_size):
            chunk = flat[start : start + self.batch_size]
            ids, attn = pad_left(chunk, pad)
            attn = attn.long()
            # generate() samples from the global RNG; seed it from our generator so a
            # resumed run draws the same samples as an uninterrupted one.
            torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
            recorder = _SampledLogprobs(sampling.temperature) if record else None
            ids, attn, cache = self._prefilled(ids, attn, n, sampling.max_new_tokens, agree)
            seqs = self.model.generate(
                input_ids=ids.to(device),
                attention_mask=attn.to(device),
                past_key_values=cache,
                generation_config=config,
                logits_processor=[guard] if recorder is None else [guard, recorder],
                synced_gpus=lockstep,
            )
            out.extend(self._responses(seqs[:, ids.shape[1] :], recorder))
        return out

    def _prefilled(self, ids, attn, n: int, new_tokens: int, agree=None):
        """``(ids, attn, cache)`` for one ``generate`` call: where the G samples of a prompt
        repeat it and sharing pays (``forward.prompt_groups``), each distinct prompt's prefix
        runs once and ``generate`` continues its cache from each row's last prompt token;
        else the plain prefill (``cache`` None). ``agree(want) -> bool`` (FSDP): the ranks'
        joint choice."""
        if n < 2 or self.share_prompt == "off":
            return ids, attn, None
        from mrtpo.core.forward import prompt_groups, prompt_prefix_cache

        groups = prompt_groups(
            self.model, ids, attn, new_tokens, self.share_prompt, in_step=agree is not None
        )
        if agree is not None and not agree(groups is not None):
            groups = None
        if groups is None:
            return ids, attn, None
        cache, _ = prompt_prefix_cache(self.model, groups, ids, attn)
        # the cache holds the rows' last `width` columns but one: generate() feeds only what
        # follows the cache, i.e. each row's last prompt token
        keep = groups.width + 1
        return ids[:, -keep:], attn[:, -keep:], cache

    def _warn_overridden_once(self, model, config) -> None:
        """Name, once per engine, the checkpoint sampling settings that are not applied."""
        if self._warned:
            return
        self._warned = True
        self.overridden = overridden_defaults(model, config)
        if self.overridden:
            log.warning(
                "the checkpoint's generation_config sets %s: not applied, sampling follows "
                "rollout.sampling only (evaluation: its eval settings)",
                ", ".join(f"{k}={v!r}" for k, v in sorted(self.overridden.items())),
            )

    def _responses(self, new: torch.Tensor, recorder: _SampledLogprobs | None) -> list[Generation]:
        """The generated rows cut after their first end token, with their log-probs if recorded."""
        table = None
        if recorder is not None:
            if new.shape[1]:
                recorder.take(new[:, -1])
            table = recorder.table()
        out: list[Generation] = []
        for r, row in enumerate(new.tolist()):
            end = next((i for i, t in enumerate(row) if t in self.eos_ids), None)
            toks, finished = (row, False) if end is None else (row[: end + 1], True)
            lps = None if table is None else table[r, : len(toks)].tolist()
            out.append(Generation(token_ids=toks, finished=finished, logprobs=lps))
        return out
