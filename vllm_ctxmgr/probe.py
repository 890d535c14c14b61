"""Checks a vLLM OpenAI endpoint over real HTTP: is it up, does it serve the new context.

What proves the context (vLLM 0.32/0.33, checked in renderers/params.py and
entrypoints/serve/utils/api_utils.py get_max_tokens, and in the captured 400/200 bodies):
- /v1/models reports `max_model_len`: the engine's own value after any auto-fit. It must equal the
  expected one.
- vLLM rejects at admission, with a 400, `max_tokens > max_model_len` and a prompt longer than
  max_model_len; it does NOT reject prompt + max_tokens > max_model_len (0.11 did), it clamps
  max_tokens to what the context leaves. So a completion with prompt + max_tokens == the expected
  context is admitted by both generations only if max_model_len >= expected. The probe streams it and
  hangs up after the first token: admission and a first token are the proof; waiting for 200K tokens
  is not needed (vLLM aborts a request whose client went away).
- `long_probe` sends a prompt of ~90% of the context with max_tokens=1: a 200 means the engine
  prefilled that many tokens into its KV cache for one request, the memory proof.

The API key goes only into the Authorization header; every text this module returns has it masked.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm_ctxmgr.masking import mask

if TYPE_CHECKING:
    import requests

PROBE_PROMPT = "Reply with one word: is the service ready?"
_FILLER_WORD = " hello"


@dataclass(frozen=True)
class ProbeStep:
    name: str
    ok: bool
    status: int | None  # HTTP status, None when no answer came
    latency_s: float
    detail: str


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    steps: tuple[ProbeStep, ...]
    latency_s: float  # the whole probe
    error: str | None = None  # what failed, vLLM's own message quoted when it sent one
    model_id: str | None = None
    max_model_len: int | None = None  # what /v1/models reported
    prompt_tokens: int | None = None

    def step(self, name: str) -> ProbeStep | None:
        return next((step for step in self.steps if step.name == name), None)


def vllm_error_message(response: requests.Response) -> str:
    """vLLM's error text: {"error": {"message": ...}}, {"error": "..."} (401) or FastAPI's detail."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:500] or response.reason
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if isinstance(error, str):
            return error
        if "message" in body:
            return str(body["message"])
        if "detail" in body:
            return json.dumps(body["detail"])
    return json.dumps(body)[:500]


@dataclass
class _Prober:
    base_url: str
    api_key: str | None
    timeout: float
    session: requests.Session
    steps: list[ProbeStep] = field(default_factory=list)

    def url(self, path: str) -> str:
        return self.base_url.rstrip("/") + path

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def masked(self, text: str) -> str:
        return mask(text, [self.api_key] if self.api_key else [])

    def call(
        self,
        name: str,
        method: str,
        path: str,
        check: Callable[[requests.Response], tuple[bool, str]],
        **kwargs: Any,
    ) -> tuple[ProbeStep, requests.Response | None]:
        """One request as one step; `check` says whether the answer is right and what it showed."""
        import requests

        started = time.monotonic()
        try:
            response = self.session.request(
                method, self.url(path), headers=self.headers(), timeout=self.timeout, **kwargs
            )
        except requests.RequestException as error:
            step = ProbeStep(
                name, False, None, time.monotonic() - started, self.masked(_connection_text(error))
            )
            self.steps.append(step)
            return step, None
        try:
            ok, detail = check(response)
        except (ValueError, KeyError, TypeError) as error:
            ok, detail = False, f"unexpected answer: {error}"
        finally:
            latency = time.monotonic() - started
        if not ok and response.status_code >= 400:
            detail = f"{response.status_code} {response.reason}: {vllm_error_message(response)}"
        step = ProbeStep(name, ok, response.status_code, latency, self.masked(detail))
        self.steps.append(step)
        return step, response


def _connection_text(error: Exception) -> str:
    import requests

    if isinstance(error, requests.Timeout):
        return f"no answer in time ({type(error).__name__})"
    if isinstance(error, requests.ConnectionError):
        return f"cannot connect: {error}"
    return f"{type(error).__name__}: {error}"


def _status_ok(response: requests.Response) -> tuple[bool, str]:
    return response.status_code == 200, f"{response.status_code} {response.reason}"


def probe(
    base_url: str,
    *,
    api_key: str | None = None,
    expected_max_model_len: int | None,
    probe_tokens: int | None = None,
    long_probe: bool = False,
    timeout: float = 60.0,
    model: str | None = None,
    session: requests.Session | None = None,
) -> ProbeResult:
    """Health, model card, a completion that needs the whole context, and optionally a ~90% prompt.

    `probe_tokens` overrides max_tokens of the context completion (default: expected context minus the
    prompt's tokens, counted by /tokenize). `model` picks a served model name (default: the first).
    Stops at the first failed step.
    Long because it is the probe's steps in order (health, models, the context-sized completion, the long
    prompt), each recorded with its own timing and error."""
    import requests

    started = time.monotonic()
    prober = _Prober(base_url, api_key, timeout, session or requests.Session())
    facts: dict[str, Any] = {}

    def result(error: str | None) -> ProbeResult:
        return ProbeResult(
            ok=error is None,
            steps=tuple(prober.steps),
            latency_s=time.monotonic() - started,
            error=prober.masked(error) if error else None,
            model_id=facts.get("model_id"),
            max_model_len=facts.get("max_model_len"),
            prompt_tokens=facts.get("prompt_tokens"),
        )

    step, _ = prober.call("health", "GET", "/health", _status_ok)
    if not step.ok:
        return result(f"/health: {step.detail}")

    def check_models(response: requests.Response) -> tuple[bool, str]:
        if response.status_code != 200:
            return False, ""
        cards = response.json()["data"]
        card = next((c for c in cards if model is None or c["id"] == model), None)
        if card is None:
            return False, f"no model {model!r} among {[c['id'] for c in cards]}"
        facts["model_id"], facts["max_model_len"] = card["id"], card.get("max_model_len")
        if expected_max_model_len is not None and card.get("max_model_len") != expected_max_model_len:
            return False, (
                f"vLLM reports max_model_len={card.get('max_model_len')} for {card['id']}, "
                f"expected {expected_max_model_len}"
            )
        return True, f"{card['id']} max_model_len={card['max_model_len']}"

    step, _ = prober.call("models", "GET", "/v1/models", check_models)
    if not step.ok:
        return result(f"/v1/models: {step.detail}")
    model_id = facts["model_id"]

    def check_tokenize(response: requests.Response) -> tuple[bool, str]:
        if response.status_code != 200:
            return False, ""
        facts["prompt_tokens"] = int(response.json()["count"])
        return True, f"prompt is {facts['prompt_tokens']} tokens"

    step, _ = prober.call(
        "tokenize", "POST", "/tokenize", check_tokenize, json={"model": model_id, "prompt": PROBE_PROMPT}
    )
    if not step.ok and step.status == 404:
        # a server without /tokenize: a one-token completion reports the prompt's length in its usage
        def check_usage(response: requests.Response) -> tuple[bool, str]:
            if response.status_code != 200:
                return False, ""
            facts["prompt_tokens"] = int(response.json()["usage"]["prompt_tokens"])
            return True, f"prompt is {facts['prompt_tokens']} tokens (from usage)"

        body = {"model": model_id, "prompt": PROBE_PROMPT, "max_tokens": 1, "temperature": 0}
        step, _ = prober.call("prompt_tokens", "POST", "/v1/completions", check_usage, json=body)
    if not step.ok:
        return result(f"{'/tokenize' if step.name == 'tokenize' else '/v1/completions'}: {step.detail}")
    prompt_tokens = facts["prompt_tokens"]
    context = expected_max_model_len or int(facts["max_model_len"])  # None: the context vLLM reports
    max_tokens = probe_tokens if probe_tokens is not None else context - prompt_tokens
    step = _context_completion(prober, model_id, max_tokens, prompt_tokens)
    if not step.ok:
        return result(f"/v1/completions (max_tokens={max_tokens}): {step.detail}")
    if long_probe:
        step = _long_prompt(prober, model_id, context)
        if not step.ok:
            return result(f"/v1/completions (long prompt): {step.detail}")
    return result(None)


def _context_completion(prober: _Prober, model_id: str, max_tokens: int, prompt_tokens: int) -> ProbeStep:
    """Stream a completion whose prompt + max_tokens fill the context; hang up after the first token."""
    import requests

    started = time.monotonic()
    body = {
        "model": model_id,
        "prompt": PROBE_PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    name = "context_completion"
    try:
        with prober.session.post(
            prober.url("/v1/completions"),
            json=body,
            headers=prober.headers(),
            timeout=prober.timeout,
            stream=True,
        ) as response:
            if response.status_code != 200:
                detail = f"{response.status_code} {response.reason}: {vllm_error_message(response)}"
                step = ProbeStep(
                    name, False, response.status_code, time.monotonic() - started, prober.masked(detail)
                )
            else:
                step = _first_token(response, name, started, prompt_tokens + max_tokens, prober)
    except requests.RequestException as error:
        step = ProbeStep(
            name, False, None, time.monotonic() - started, prober.masked(_connection_text(error))
        )
    prober.steps.append(step)
    return step


def _first_token(
    response: requests.Response, name: str, started: float, total: int, prober: _Prober
) -> ProbeStep:
    for raw in response.iter_lines(decode_unicode=True):
        if not raw or not raw.startswith("data: "):
            continue
        data = raw.removeprefix("data: ")
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            message = chunk["error"].get("message") if isinstance(chunk["error"], dict) else chunk["error"]
            return ProbeStep(
                name, False, 200, time.monotonic() - started, prober.masked(f"stream error: {message}")
            )
        if chunk.get("choices"):
            return ProbeStep(
                name,
                True,
                200,
                time.monotonic() - started,
                f"admitted prompt + max_tokens = {total} tokens; first token after "
                f"{time.monotonic() - started:.2f} s",
            )
    return ProbeStep(name, False, 200, time.monotonic() - started, "the stream ended without a token")


def _long_prompt(prober: _Prober, model_id: str, expected_max_model_len: int) -> ProbeStep:
    """A prompt of ~90% of the context, sized with /tokenize, and one output token."""
    target = int(expected_max_model_len * 0.9)
    sample_words = 1000
    sample = prober.session.post(
        prober.url("/tokenize"),
        json={"model": model_id, "prompt": _FILLER_WORD * sample_words},
        headers=prober.headers(),
        timeout=prober.timeout,
    )
    per_word = sample.json()["count"] / sample_words if sample.status_code == 200 else 1.0
    prompt = _FILLER_WORD * max(1, int(target / max(per_word, 1e-6)))

    def check(response: requests.Response) -> tuple[bool, str]:
        if response.status_code != 200:
            return False, ""
        usage = response.json()["usage"]
        return True, f"prefilled {usage['prompt_tokens']} prompt tokens (target {target})"

    step, _ = prober.call(
        "long_prompt",
        "POST",
        "/v1/completions",
        check,
        json={"model": model_id, "prompt": prompt, "max_tokens": 1, "temperature": 0},
    )
    return step


def wait_until_serving(
    base_url: str, deadline: float, *, interval_s: float = 0.5, session: requests.Session | None = None
) -> bool:
    """Poll /health until it answers 200 or `deadline` (a time.monotonic() value) passes."""
    import requests

    session = session or requests.Session()
    url = base_url.rstrip("/") + "/health"
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        try:
            if session.get(url, timeout=max(0.1, min(5.0, remaining))).status_code == 200:
                return True
        except requests.RequestException:
            pass
        time.sleep(min(interval_s, max(0.0, deadline - time.monotonic())))


def cache_config_info(base_url: str, *, api_key: str | None = None, timeout: float = 10.0) -> dict[str, str]:
    """The labels of vLLM's `vllm:cache_config_info` metric (num_gpu_blocks, block_size, ...).

    num_gpu_blocks is the exact KV capacity of the start; {} when /metrics is off or unreadable.
    """
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = requests.get(f"{base_url.rstrip('/')}/metrics", headers=headers, timeout=timeout)
    except requests.RequestException:
        return {}
    if response.status_code != 200:
        return {}
    try:
        for family in text_string_to_metric_families(response.text):
            if family.name == "vllm:cache_config_info":
                for sample in family.samples:
                    return dict(sample.labels)
    except ValueError:
        return {}
    return {}
