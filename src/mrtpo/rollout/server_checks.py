"""What the run checks before it trusts a vLLM server, and how a failed request is told.

``ServerChecks`` is the part of ``VLLMServerEngine`` (``mrtpo.rollout.vllm_server``) that
talks to a server before the run uses it: the key proof (``_prove``: a server must show that
it holds the run's key before it gets any request), ``/health``, and the start-up checks (the
``mrtpo_file`` weight-transfer backend, the served architecture, the tokenizer, the
token-in/token-out route and tempered log-probs). ``_failure`` and ``_bad_answer`` turn a
failed request (``RequestFailed``) or an unusable answer (``BadAnswer``) into one line
naming the server (``VLLMServerError``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any
from urllib.parse import urlsplit

import torch

from mrtpo.core.errors import CompactHydraException
from mrtpo.rollout import server_answers
from mrtpo.rollout.server_answers import BadAnswer, as_object, field
from mrtpo.rollout.server_client import RequestFailed, ServerClient
from mrtpo.rollout.server_process import (
    BACKEND,
    LAUNCHER,
    ServerProcess,
    ask_proof,
    is_loopback,
    new_nonce,
    proves,
)
from mrtpo.rollout.vllm import _model_config

log = logging.getLogger(__name__)

#: what must agree between the policy's config and the served model's config.json
ARCH_KEYS = (
    "architectures",
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
)
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_PROBE = [{"role": "user", "content": "Write three words about rivers, then stop."}]
PROBE_TOP = 5  # top log-probs per token in the log-prob probe (vLLM allows 20 by default)


class VLLMServerError(CompactHydraException, RuntimeError):
    """The vLLM server died, cannot be reached, did not answer in time, refused a request,
    or cannot serve this run. Its message is one line (Hydra prints it alone)."""


def _policy_config(model: torch.nn.Module) -> dict[str, Any]:
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    cfg = getattr(base, "config", None)
    return cfg.to_dict() if cfg is not None and hasattr(cfg, "to_dict") else {}


def _architecture(cfg: dict[str, Any]) -> str:
    arch = cfg.get("architectures") or [cfg.get("model_type", "?")]
    return (
        f"{'/'.join(map(str, arch))}, hidden {cfg.get('hidden_size')}, "
        f"{cfg.get('num_hidden_layers')} layers, vocab {cfg.get('vocab_size')}"
    )


class ServerChecks:
    """The key proof, the health wait, the start-up checks and the one-line failures of
    ``VLLMServerEngine`` (which sets the attributes named here)."""

    model: str
    url: str | None
    api_key_env: str
    seed: int
    start_timeout_s: float
    request_timeout_s: float
    process: ServerProcess | None
    served: str
    logprobs_mode: str | None
    _key: str | None
    _push_dtype: torch.dtype | None
    _policy: torch.nn.Module | None
    _tokenizer: Any

    def _wait_healthy(self, client: ServerClient) -> None:
        """Wait for the key proof (``_prove``), then for ``/health`` (with the key)."""
        deadline = time.monotonic() + float(self.start_timeout_s)
        last = ""
        while time.monotonic() < deadline:
            if self.process is not None and not self.process.alive():
                raise VLLMServerError(
                    f"the vLLM server for {self.model} {self.process.how_it_ended()} while "
                    f"starting ({self.process.log_tail()}); its log: {self.process.log_path}"
                )
            try:
                client.url = self.url = self._prove(client.url)
                client.get("/health", timeout_s=10)
                return
            except RequestFailed as exc:
                last = exc.detail
            time.sleep(1.0)
        where = f"; its log: {self.process.log_path}" if self.process is not None else ""
        raise VLLMServerError(
            f"the vLLM server at {client.url} did not answer /health within "
            f"{self.start_timeout_s:g} s (rollout.engine.start_timeout_s; last: {last}){where}"
        )

    def _prove(self, url: str) -> str:
        """The server at ``url`` must prove that it holds the run's key before it gets any
        request or the key: it answers a fresh nonce with ``proof(key, nonce, address)`` (an
        HMAC) on the one route that needs no key (``mrtpo.rollout.vllm_serve``), ``address``
        being where this connection reached it. A process that bound the port first sees the
        nonce alone and cannot answer it; one that relays it to the real server gets a proof
        for another address. Any answer but the proof stops the run; no answer yet (not
        listening, busy starting) is asked again. Returns the URL to use from now on: over
        http, the proven numeric address (a name resolved again may lead elsewhere)."""
        if self._key is None:
            log.warning("no API key in %s: the run cannot check that %s is the server meant "
                        "(and anyone who reaches it can call its RL routes)", self.api_key_env,
                        url)  # fmt: skip
            return url
        nonce = new_nonce()
        try:
            answer, address = ask_proof(url, nonce)
        except RequestFailed as exc:
            if exc.kind != "refused":
                raise
            answer, address = f"HTTP {exc.status}: {exc.detail}", ""
        if proves(answer, self._key, nonce, address):
            return self._proven_url(url, address)
        seen = " ".join(str(answer).split())[:120]
        if self.process is None:
            raise VLLMServerError(
                f"the server at {url} did not prove that it holds the key in {self.api_key_env} "
                f"for the address the run reached ({address or 'none'}; it answered {seen!r}; "
                f"the key was not sent): start it with `python -m {LAUNCHER}` of this version "
                "and that key, reach it directly (no relay or port mapping), and check "
                "rollout.engine.url"
            )
        raise VLLMServerError(
            f"the process answering at {url} is not the vLLM server the run started: it could "
            f"not prove that it holds the run's key (it answered {seen!r}; nothing else and no "
            f"key was sent). Another process holds port {urlsplit(url).port}: stop it, or set "
            "rollout.engine.port to a free port"
        )

    def _proven_url(self, url: str, address: str) -> str:
        parts = urlsplit(url)
        if parts.scheme != "http":
            return url  # https: the certificate names the host
        if not is_loopback(address.rsplit(":", 1)[0].strip("[]")):
            log.warning("the run sends the key in %s to %s over plain http, in clear text "
                        "for anyone on the network path: serve https (vLLM's --ssl-keyfile and "
                        "--ssl-certfile) or use an SSH tunnel that keeps the address and port "
                        "(ssh -L 127.0.0.1:P:127.0.0.1:P, the server on 127.0.0.1:P there, "
                        "rollout.engine.url=http://127.0.0.1:P); a tunnel that maps the port "
                        "fails the key proof", self.api_key_env, url)  # fmt: skip
        return f"http://{address}{parts.path.rstrip('/')}"

    # -- what the server must be -------------------------------------------------------------

    def _check_server(self, client: ServerClient) -> None:
        """Refuse a server that lacks the routes or backend this run needs, or that serves
        another model; read its dtype and log-prob mode."""
        what = "the start-up check"
        info = self._call(lambda: as_object(client.get("/server_info?config_format=json")),
                          what=what)  # fmt: skip
        vcfg = info.get("vllm_config") if isinstance(info.get("vllm_config"), dict) else {}
        wcfg = vcfg.get("weight_transfer_config")
        backend = wcfg.get("backend") if isinstance(wcfg, dict) else None
        if backend != BACKEND:
            raise VLLMServerError(
                f"the vLLM server at {client.url} has weight transfer backend {backend!r}, not "
                f"{BACKEND!r}: start it with `python -m {LAUNCHER} ... --weight-transfer-config "
                f'\'{{"backend": "{BACKEND}"}}\'` and MRTPO_WEIGHT_ROOT=<weight folder> '
                "(docs/scaling.md)"
            )
        mcfg = vcfg.get("model_config") if isinstance(vcfg.get("model_config"), dict) else {}
        self.logprobs_mode = mcfg.get("logprobs_mode")
        self._push_dtype = _TORCH_DTYPES.get(str(mcfg.get("dtype", "")).removeprefix("torch."))
        self.served = self._call(lambda: server_answers.served_model(client.get("/v1/models")),
                                 what=what)  # fmt: skip
        self._check_architecture(client.url)
        self._check_tokenizer(client)
        self._probe_generate(client)

    def _check_architecture(self, url: str) -> None:
        if self._policy is None:
            return
        mine, theirs = _policy_config(self._policy), _model_config(self.served)
        if not theirs:
            log.info(
                "cannot read %s/config.json here: the first weight push checks it", self.served
            )
            return
        diff = [k for k in ARCH_KEYS if k in mine and k in theirs and mine[k] != theirs[k]]
        if diff:
            raise VLLMServerError(
                f"the vLLM server at {url} serves {self.served} ({_architecture(theirs)}) but the "
                f"policy is {self.model} ({_architecture(mine)}; {', '.join(diff)} differ): "
                "start the server with --model <the policy's folder>"
            )

    def _check_tokenizer(self, client: ServerClient) -> None:
        tok = self._tokenizer
        if tok is None:
            return
        try:
            text = tok.apply_chat_template(_PROBE, add_generation_prompt=True, tokenize=False)
        except Exception:
            text = _PROBE[0]["content"]
        mine = list(tok(text, add_special_tokens=False)["input_ids"])
        body = {"prompt": text, "add_special_tokens": False}
        theirs = self._call(lambda: field(client.post("/tokenize", body), "tokens", list),
                            what="the tokenizer check")  # fmt: skip
        if mine != theirs:
            at = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), len(mine))
            raise VLLMServerError(
                f"the vLLM server at {client.url} serves {self.served}, whose tokenizer does "
                f"not match the policy's ({self.model}): the probe text {text[:60]!r} gives "
                f"{len(theirs)} tokens there and {len(mine)} here, first different at token "
                f"{at}. Start the server with --model <the policy's folder>"
            )

    def _probe_generate(self, client: ServerClient) -> None:
        """Refuse a server without the token-in/token-out route, or whose log-probs are not
        those of the distribution it samples (the loss needs log softmax(z / T)). One token
        is sampled at temperature 1 and at 0.5 from the same prompt: tempered log-probs
        double every gap between two tokens' log-probs at 0.5, the model's own keep it."""
        tops = [self._probe_top(client, t) for t in (1.0, 0.5)]
        common = set(tops[0]) & set(tops[1])
        if not common:  # tempering keeps the tokens' order: the same prompt shares its top
            raise self._bad_answer("the log-prob probe", BadAnswer(
                f"no top token in common at temperature 1 ({sorted(tops[0])[:PROBE_TOP]}) and "
                f"0.5 ({sorted(tops[1])[:PROBE_TOP]}) for the same seeded prompt"))  # fmt: skip
        gaps = [max(top[t] for t in common) - min(top[t] for t in common) for top in tops]
        if gaps[0] > 1e-3:  # else the tokens are too close to tell: trust the server's word
            tempered, seen = gaps[1] / gaps[0] > 1.5, f"{gaps[1] / gaps[0]:.2f} x"
        else:
            tempered, seen = self.logprobs_mode == "processed_logprobs", "too close to tell"
        if not tempered:
            raise VLLMServerError(
                f"the vLLM server at {client.url} reports the model's own log-probs, not those "
                f"of the distribution it samples (logprobs mode {self.logprobs_mode!r}; the "
                f"gaps between its top log-probs at temperature 0.5 are {seen} those at "
                "temperature 1, where they would be 2 x): start it with --logprobs-mode "
                "processed_logprobs"
            )

    def _probe_top(self, client: ServerClient, temperature: float) -> dict[int, float]:
        """The top log-probs of one token sampled at ``temperature`` (a seeded request)."""
        params = {"n": 1, "max_tokens": 1, "temperature": temperature, "seed": self.seed,
                  "logprobs": PROBE_TOP, "detokenize": False}  # fmt: skip
        body = {"token_ids": [0], "sampling_params": params}
        try:
            answer = client.post("/inference/v1/generate", body)
        except RequestFailed as exc:
            if exc.status in (403, 404):
                raise VLLMServerError(
                    f"the vLLM server at {client.url} does not offer /inference/v1/generate "
                    f"(HTTP {exc.status}): start it with --enable-scale-out"
                ) from None
            raise self._failure("the start-up check", exc) from None
        return self._call(lambda: server_answers.top_logprobs(answer, PROBE_TOP),
                          what="the log-prob probe")  # fmt: skip

    # -- failures ----------------------------------------------------------------------------

    def _call(self, fn, *args: Any, what: str) -> Any:
        """``fn(*args)``: a request and what reads its answer; a failure is one line."""
        try:
            return fn(*args)
        except RequestFailed as exc:
            raise self._failure(what, exc) from None
        except BadAnswer as exc:
            raise self._bad_answer(what, exc) from None

    def _bad_answer(self, what: str, exc: BadAnswer) -> VLLMServerError:
        return VLLMServerError(
            f"the vLLM server at {self.url} sent an answer the run cannot use during {what}: "
            f"{exc.detail}"
        )

    def _failure(self, what: str, exc: RequestFailed) -> VLLMServerError:
        """One line: what happened to the server during ``what``."""
        proc = self.process
        if proc is not None and exc.kind != "refused" and proc.proc is not None:
            with contextlib.suppress(Exception):
                proc.proc.wait(timeout=5)  # a killed server may still be exiting
        if proc is not None and not proc.alive():
            message = (
                f"the vLLM server the run started (pid {proc.pid}, {self.url}) "
                f"{proc.how_it_ended()} during {what}; its log: {proc.log_path}"
            )
            proc.stop()  # what is left of its process group
            return VLLMServerError(message)
        if exc.kind == "refused":
            return VLLMServerError(
                f"the vLLM server at {self.url} refused {what} (HTTP {exc.status}: {exc.detail})"
            )
        if exc.kind == "timeout":
            return VLLMServerError(
                f"the vLLM server at {self.url} did not answer {what} within "
                f"{self.request_timeout_s:g} s (rollout.engine.request_timeout_s): {exc.detail}"
            )
        return VLLMServerError(
            f"the vLLM server at {self.url} cannot be reached during {what} ({exc.detail}): it "
            "is not running, or the network to it is down"
        )
