"""Loading policies, and the tiny offline model used by tests, CI and `make train`.

Every model, the tiny one included, loads through ``from_pretrained``, so the code that
trains a 7B model is the code the tests run. The tiny model (random weights, an in-process
byte-level BPE, a Qwen-style chat template) is built once into the cache folder.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from mrtpo.core.lora import LoraSettings, apply_lora
from mrtpo.tasks.synthetic.task import WORDS

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Qwen-style template: the assistant turn ends with <|im_end|>, which is the EOS token.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Text the tokenizer's merges are learned from: the vocabulary of the built-in tasks, so the
# tiny model sees words as few tokens. Any byte sequence still tokenizes (byte-level BPE).
_CORPUS_TEXT = " ".join(
    [
        (
            "the a an and or of to in on for with is are was be as by it this that at from you "
            "your write answer response reply question sentence word words first last must not "
            "include end start begin exactly contain containing use using only one two three four "
            "five six seven eight nine ten"
        ),
        *WORDS,  # the synthetic task's vocabulary, in its order
        (
            "fast slow warm cold old new good think answer tool_call response select from where "
            "group by order limit join count sum avg max min distinct as on inner left union "
            "intersect except having desc asc like between null name parameters true false json "
            "sql table column value values id user assistant system"
        ),
    ]
)
_CORPUS_LINES = [
    "<think> reasoning </think> <answer> ```sql SELECT name FROM singer ; ``` </answer>",
    '<tool_call> {"name": "search", "parameters": {"query": "weather"}} </tool_call>',
    "<response> Here is the answer. </response>",
    "Write a short reply. Start with the word apple. End with the word river.",
]


@dataclass
class TinyModelConfig:
    """Shape of the tiny offline policy (a Qwen2 causal LM with random weights)."""

    vocab_size: int = 1024
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 8192
    # Std of the random initial weights. The 0.02 of large models leaves a model this narrow
    # on a long plateau before attention learns to look things up; ~1/sqrt(hidden) does not.
    initializer_range: float = 0.02
    seed: int = 0
    extra_corpus: list[str] = field(default_factory=list)

    def fingerprint(self) -> str:
        return json.dumps({**self.__dict__, "extra_corpus": len(self.extra_corpus)}, sort_keys=True)


def build_tokenizer(vocab_size: int = 1024, extra_corpus: list[str] | None = None):
    """A byte-level BPE tokenizer with a Qwen-style chat template, trained in-process."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [_CORPUS_TEXT] * 4 + _CORPUS_LINES + list(extra_corpus or [])
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "left"
    return fast


def build_tiny_model(path: str | Path, config: TinyModelConfig | None = None) -> Path:
    """Build the tiny model and tokenizer into ``path`` (skipped if already built alike)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = config or TinyModelConfig()
    path = Path(path)
    stamp = path / "mrtpo_tiny.json"
    if stamp.exists() and stamp.read_text() == cfg.fingerprint():
        return path
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(cfg.vocab_size, cfg.extra_corpus)
    torch.manual_seed(cfg.seed)
    shape = {
        k: v for k, v in asdict(cfg).items() if k not in ("vocab_size", "seed", "extra_corpus")
    }
    model_cfg = Qwen2Config(
        **shape,
        vocab_size=len(tokenizer),
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen2ForCausalLM(model_cfg)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    # Write to a temporary folder and rename, so a crash never leaves a half-built model.
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "mrtpo_tiny.json").write_text(cfg.fingerprint())
    for f in tmp.iterdir():
        f.replace(path / f.name)
    tmp.rmdir()
    log.info("built tiny model at %s", path)
    return path


def _holds_model(path: Path) -> bool:
    return (path / "config.json").is_file() or any(path.glob("*.safetensors"))


def may_build_tiny(name_or_path: str | Path, build_root: str | Path | None) -> bool:
    """Whether the tiny model may be (re)built into ``name_or_path``: only inside ``build_root``
    (``model.tiny.build_root``) and never over a model the project did not build (weights but no
    ``mrtpo_tiny.json``). Any other path, e.g. ``model=tiny`` with ``model.name_or_path=/my/model``,
    loads as any model, its folder left byte for byte as it was.
    """
    path = Path(name_or_path)
    ours = (path / "mrtpo_tiny.json").is_file()
    if path.exists() and not ours and _holds_model(path):
        log.info("model.tiny is ignored: %s already holds a model, which is loaded as it is", path)
        return False
    if build_root is not None:
        root = Path(build_root).resolve()
        inside = path.resolve() == root or root in path.resolve().parents
        if not inside:
            if path.exists() and _holds_model(path):
                return False
            raise FileNotFoundError(
                f"model.name_or_path={name_or_path} holds no model, and the tiny model is only "
                f"ever built under {root} (model.tiny.build_root, from paths.cache_dir). Point "
                "model.name_or_path at a folder with config.json and weights, or leave it at "
                "its default to build the tiny model."
            )
    elif path.exists() and not ours and any(path.iterdir()):
        raise FileExistsError(
            f"{path} is not empty and was not built as the tiny model; refusing to write into it"
        )
    return True


#: model.dtype (and the sharding mixed-precision keys) -> torch dtype
DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"model.dtype={name!r} is not supported; use one of {sorted(DTYPES)}")
    return DTYPES[name]


def load_policy(
    name_or_path: str,
    dtype: str = "fp32",
    gradient_checkpointing: bool = False,
    tiny: dict[str, Any] | None = None,
    attn_implementation: str | None = None,
    lora: Mapping[str, Any] | None = None,
):
    """Load (model, tokenizer) by hub id or local path. ``tiny`` builds the tiny model first where
    that destroys nothing (``may_build_tiny``); ``lora`` with ``r > 0`` wraps it in PEFT adapters,
    the only trained weights (``apply_lora``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if tiny is not None:
        tiny = dict(tiny)
        root = tiny.pop("build_root", None)
        if may_build_tiny(name_or_path, root):
            build_tiny_model(name_or_path, TinyModelConfig(**tiny))
    kwargs: dict[str, Any] = {"dtype": resolve_dtype(dtype)}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        model = AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
    except OSError as exc:
        raise OSError(
            f"could not load model '{name_or_path}': {exc}\n"
            "Without network, set model.name_or_path to a local folder holding the weights "
            "(e.g. `model.name_or_path=/models/Qwen2.5-7B-Instruct`), or use model=tiny."
        ) from exc
    return prepare_policy(model, tokenizer, gradient_checkpointing, lora, name_or_path)


def prepare_policy(
    model: Any,
    tokenizer: Any,
    gradient_checkpointing: bool = False,
    lora: Mapping[str, Any] | None = None,
    name: str = "the given model",
) -> tuple[Any, Any]:
    """A loaded or given (model, tokenizer) made ready to train: an EOS (else a clear error),
    a pad token, left padding, gradient checkpointing, LoRA adapters and train mode."""
    if tokenizer.eos_token_id is None and not eos_token_ids(tokenizer, model):
        raise ValueError(
            f"the tokenizer of {name} has no EOS token (and its generation_config names "
            "none): responses could never end. Use a tokenizer with an eos_token (chat models "
            "have one), or set it in the model folder's tokenizer_config.json"
        )
    if tokenizer.pad_token_id is None:
        # padding is masked everywhere; any token will do, the EOS is the usual choice
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.convert_ids_to_tokens(
            eos_token_ids(tokenizer, model)[0]
        )
    tokenizer.padding_side = "left"
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    settings = LoraSettings.from_mapping(lora)
    if settings.enabled:
        if gradient_checkpointing:
            # With frozen embeddings no checkpointed block input requires grad, and reentrant
            # checkpointing would then give the adapters no gradient at all.
            model.enable_input_require_grads()
        model = apply_lora(model, settings)
    model.train()  # from_pretrained returns eval mode
    return model, tokenizer


def eos_token_ids(tokenizer, model=None) -> list[int]:
    """Every token id that ends a response (tokenizer EOS and the generation config's)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    extra = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(extra, int):
        ids.add(extra)
    elif extra:
        ids.update(int(i) for i in extra)
    return sorted(ids)
