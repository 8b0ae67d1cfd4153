"""An OpenAI-compatible upstream as the cloud's answerer: vLLM, SGLang, llama.cpp's server, Ollama, our own API.

With ``[cloud] backend = "openai"`` the escalation worker sends each escalation to
``{upstream_url}/chat/completions`` instead of running the engine in this process (which then
never imports torch). The request carries what the engine path uses: the action's JSON
Schema (``response_format: {type: json_schema}``), greedy decoding (the escalation's
temperature, 0 by default), ``max_tokens``, vLLM's ``priority`` field (the escalation's
priority: 0 = most urgent, the same direction as vLLM's) and ``logprobs`` with
``top_logprobs`` so that confidence is scored by the edge's rule
(:func:`apiary.cloud.actions.score_openai_logprobs`). The answer goes through the edge's parser
(:func:`apiary.cloud.actions.action_outcome`), exactly as the engine's does.

Failures, and what the worker makes of them:

* connection errors, timeouts, 408/5xx: retried with exponential backoff (``Retry-After``
  honoured) for up to ``retry_s``; then :class:`UpstreamUnavailable`, and the worker leaves the
  escalation unfinished (its claim released, no reply) for the edge's re-send. A deadline that
  passes first makes it ``expired``, as on the engine path;
* 429: retried the same way; then :class:`UpstreamOverloaded` (``deferred``);
* any other 4xx: :class:`UpstreamRejected` (``rejected``, with the upstream's message);
* a 200 that is not a chat completion: :class:`UpstreamError` (``error``).
"""
from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from apiary.shared.logs import get_logger
from apiary.shared.prompting import ACTION_JSON_SCHEMA

from apiary.cloud.actions import TOP_LOGPROBS, ActionOutcome, action_outcome, score_openai_logprobs
from apiary.cloud.api.health import Lifecycle

_log = get_logger("apiary.cloud.upstream")

RETRY_STATUS = frozenset({408, 500, 502, 503, 504})
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "action", "schema": ACTION_JSON_SCHEMA,
                                                          "strict": True}}


class UpstreamError(Exception):
    """The upstream answered with something that is not a chat completion."""


class UpstreamRejected(UpstreamError):
    """The upstream refused the request (a 4xx other than 408/429): sending it again would not help."""


class UpstreamOverloaded(UpstreamError):
    """The upstream kept answering 429 for the whole retry window."""


class UpstreamUnavailable(UpstreamError):
    """The upstream could not be reached (or kept failing with 5xx) for the whole retry window."""


def read_key(key_file: str | None, key_env: str | None) -> str | None:
    """The upstream's API key, from a file (first line) or an environment variable; never from the config."""
    if key_file:
        try:
            key = Path(key_file).expanduser().read_text().strip()
        except OSError as e:
            raise UpstreamError(f"cannot read the upstream key file {key_file}: {e}") from None
        if not key:
            raise UpstreamError(f"the upstream key file {key_file} is empty")
        return key
    if key_env:
        key = os.environ.get(key_env, "").strip()
        if not key:
            raise UpstreamError(f"the upstream key variable ${key_env} is not set")
        return key
    return None


@dataclass(slots=True)
class UpstreamConfig:
    url: str  # the OpenAI base URL, e.g. http://vllm:8000/v1
    model: str  # the "model" field of each request
    key: str | None = None
    prompt_style: str = "examples"  # how the upstream model is asked (shared.prompting.PROMPT_STYLES)
    timeout_s: float = 120.0  # one HTTP request, connect to last byte
    retry_s: float = 300.0  # how long connection errors, 5xx and 429 are retried before giving up
    max_backoff_s: float = 5.0
    send_priority: bool = True  # vLLM refuses a priority unless started with --scheduling-policy priority
    logprobs: bool = True  # ask for logprobs (confidence); off for an upstream that refuses them


@dataclass
class UpstreamLifecycle(Lifecycle):
    """``/ready`` for a process without a model: ready while the upstream answered its last probe."""

    model_loaded: bool = True  # nothing to load
    upstream_problem: str | None = "the upstream has not been probed yet"

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        ready, body = super().readiness()
        problem = self.upstream_problem
        body["upstream"] = problem or "answering"
        if problem:
            body["reasons"].append(problem)
            body["status"] = "not ready"
        return ready and not problem, body


class UpstreamClient:
    """Chat completions against one upstream, from the worker's event loop; ``probe`` from any thread."""

    def __init__(self, config: UpstreamConfig) -> None:
        self.config = config
        self.url = config.url.rstrip("/")
        self.prompt_style = config.prompt_style
        self._headers = {"Authorization": f"Bearer {config.key}"} if config.key else {}
        self._client: httpx.AsyncClient | None = None
        self.stats = {"requests": 0, "retries": 0, "running": 0, "failures": 0}
        self._stop = threading.Event()
        self._prober: threading.Thread | None = None

    def watch(self, lifecycle: UpstreamLifecycle, every_s: float) -> None:
        """Probe now, then every ``every_s`` s in a thread, and keep ``lifecycle`` (``/ready``) up to date."""
        def probe() -> None:
            problem = self.probe()
            if problem != lifecycle.upstream_problem:
                (_log.warning if problem else _log.info)("upstream %s: %s", self.url, problem or "answers")
            lifecycle.upstream_problem = problem

        def loop() -> None:
            while not self._stop.wait(every_s):
                probe()

        probe()
        self._prober = threading.Thread(target=loop, name="upstream-probe", daemon=True)
        self._prober.start()

    def shutdown(self) -> None:
        """Stop probing (the worker's loop, which owns the HTTP client, is stopped by the worker)."""
        self._stop.set()
        if self._prober is not None:
            self._prober.join(10)

    # ---- readiness ------------------------------------------------------------------------------
    def probe(self, timeout: float = 5.0) -> str | None:
        """None when the upstream answers ``GET /models`` (and lists the model, when it lists any); else why not."""
        try:
            r = httpx.get(f"{self.url}/models", headers=self._headers, timeout=timeout)
        except httpx.HTTPError as e:
            return f"upstream {self.url} does not answer: {type(e).__name__}: {e}"
        if r.status_code != 200:
            return f"upstream {self.url}/models answered {r.status_code}: {r.text[:200]}"
        try:
            listed = {m.get("id") for m in r.json().get("data", [])}
        except (ValueError, AttributeError):
            return f"upstream {self.url}/models answered something that is not a model list: {r.text[:200]!r}"
        if listed and self.config.model not in listed:
            return f"upstream {self.url} does not serve model {self.config.model!r} (it lists {sorted(listed)})"
        return None

    def metrics(self) -> dict[str, Any]:
        """What ``/healthz`` and the drain read where the engine's metrics would be."""
        return {"backend": "openai", "upstream": self.url, "requests_running": self.stats["running"],
                "requests_waiting": 0, **{f"upstream_{k}": v for k, v in self.stats.items() if k != "running"}}

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    # ---- requests -------------------------------------------------------------------------------
    async def answer(self, messages: list[dict[str, Any]], *, action: bool, max_tokens: int,
                     temperature: float = 0.0, priority: int = 6) -> ActionOutcome:
        """One escalation: the Action under its JSON Schema (``action``), else plain text."""
        body: dict[str, Any] = {"model": self.config.model, "messages": messages, "max_tokens": max_tokens,
                                "temperature": temperature, "stream": False}
        if temperature == 0:
            body["top_p"] = 1.0  # greedy: no nucleus cut (vLLM and llama.cpp pick the argmax at temperature 0)
        if self.config.send_priority:
            body["priority"] = priority
        if action:
            body["response_format"] = RESPONSE_FORMAT
            if self.config.logprobs:
                body.update(logprobs=True, top_logprobs=TOP_LOGPROBS)
        doc = await self._post("/chat/completions", body)
        try:
            choice = doc["choices"][0]
            text = choice["message"]["content"] or ""
            finish = choice.get("finish_reason")
            usage = doc.get("usage") or {}
            prompt_tokens, completion_tokens = int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise UpstreamError(f"upstream {self.url} answered a body that is not a chat completion "
                                f"({type(e).__name__}: {e}): {str(doc)[:200]}") from None
        if not action:
            return ActionOutcome(text, None, None, prompt_tokens, completion_tokens)
        content = ((choice.get("logprobs") or {}).get("content")) or None
        confidence = score_openai_logprobs(text, content) if content else None
        parsed, error = action_outcome(text, finish, max_tokens)
        return ActionOutcome(text, parsed, error, prompt_tokens, completion_tokens, confidence=confidence)

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST with retries (see the module docstring); the parsed JSON body of a 200."""
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.config.timeout_s, headers=self._headers)
        give_up = time.monotonic() + self.config.retry_s
        delay, last = 0.2, ""
        self.stats["requests"] += 1
        self.stats["running"] += 1
        try:
            while True:
                wait = delay
                try:
                    r = await self._client.post(f"{self.url}{path}", json=body)
                except httpx.TransportError as e:
                    last = f"{type(e).__name__}: {e}"
                else:
                    if r.status_code == 200:
                        try:
                            return r.json()
                        except ValueError:
                            raise UpstreamError(f"upstream {self.url}{path} answered 200 with a body that is not "
                                                f"JSON: {r.text[:200]!r}") from None
                    last = f"{r.status_code}: {r.text[:300]}"
                    if r.status_code != 429 and r.status_code not in RETRY_STATUS:
                        raise UpstreamRejected(f"upstream {self.url}{path} refused the request with {last}")
                    wait = max(delay, _retry_after(r))
                if time.monotonic() + wait > give_up:
                    self.stats["failures"] += 1
                    kind = UpstreamOverloaded if last.startswith("429") else UpstreamUnavailable
                    raise kind(f"upstream {self.url}{path} failed for {self.config.retry_s:g} s, last: {last}")
                self.stats["retries"] += 1
                _log.info("upstream %s%s failed (%s); retrying in %.1f s", self.url, path, last, wait)
                await asyncio.sleep(wait)
                delay = min(delay * 2, self.config.max_backoff_s)
        finally:
            self.stats["running"] -= 1


def build_upstream(settings: Any) -> UpstreamClient:
    """The client ``CloudSettings`` (``backend = "openai"``) describe; its key read now, from file or environment."""
    from apiary.cloud.errors import CloudError

    try:
        key = read_key(settings.upstream_key_file, settings.upstream_key_env)
    except UpstreamError as e:
        raise CloudError(str(e)) from None
    return UpstreamClient(UpstreamConfig(
        url=settings.upstream_url, model=settings.upstream_model, key=key, prompt_style=settings.upstream_prompt_style,
        timeout_s=settings.upstream_timeout_s, retry_s=settings.upstream_retry_s,
        send_priority=settings.upstream_priority, logprobs=settings.upstream_logprobs))


INFERENCE_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models")


class InferenceElsewhere:
    """ASGI front of the app for a process without a model: the OpenAI routes answer 404 naming the upstream
    (an OpenAI client does not retry a 404), everything else (fleet, images, probes, metrics) is the app's."""

    def __init__(self, app: Any, upstream_url: str) -> None:
        self.app = app
        self.message = (f"this cloud process serves no model (backend = \"openai\"): it answers escalations "
                        f"through {upstream_url}; send inference requests there")

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if not path.startswith(INFERENCE_PATHS):
            await self.app(scope, receive, send)
            return
        while (await receive()).get("more_body", False):  # read the body: closing on unread bytes resets
            pass
        data = json.dumps({"error": {"message": self.message, "type": "invalid_request_error", "param": None,
                                     "code": "model_not_served"}}).encode()
        await send({"type": "http.response.start", "status": 404,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})


def _retry_after(r: httpx.Response) -> float:
    try:
        return min(float(r.headers.get("retry-after", 0)), 60.0)
    except ValueError:
        return 0.0
