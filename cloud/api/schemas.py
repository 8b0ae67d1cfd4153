"""Request and response bodies of the OpenAI-compatible endpoints (the subset we serve).

Only what the engine really does is accepted: one choice (``n=1``), no logprobs, no
penalties other than 0. Anything else is a 422 that names the field, never silently
ignored. ``priority`` is our extension: 0 (most urgent) to 9, the same scale as the
mesh's ``InferenceRequest.priority`` and the engine's scheduler.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Priority = Annotated[int, Field(ge=0, le=9, description="0 = most urgent, 9 = least (extension)")]
MAX_STOP = 4
MAX_PROMPT_CHARS = 200_000


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(default=None, max_length=256)
    max_tokens: int | None = Field(default=None, ge=1, le=32768)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, description="only 1 is supported")
    stream: bool = False
    stream_options: "StreamOptions | None" = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    user: str | None = Field(default=None, max_length=256)
    presence_penalty: float = Field(default=0.0, description="only 0 is supported")
    frequency_penalty: float = Field(default=0.0, description="only 0 is supported")
    logprobs: bool | int | None = Field(default=None, description="not supported: omit, null or false")
    priority: Priority | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(not s or len(s) > 64 for s in stops):
            raise ValueError("stop sequences must be 1-64 characters")
        return stops

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float) -> float:
        if v != 0:
            raise ValueError("penalties are not supported; use 0")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: Any) -> Any:
        if v:
            raise ValueError("logprobs are not supported")
        return v


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str = Field(max_length=MAX_PROMPT_CHARS)


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)] | Annotated[list[TextPart], Field(max_length=256)]
    name: str | None = Field(default=None, max_length=64)

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessageIn] = Field(min_length=1, max_length=256)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=32768)

    @model_validator(mode="after")
    def _max(self) -> "ChatCompletionRequest":
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


class CompletionRequest(_Request):
    prompt: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)] | Annotated[list[int], Field(max_length=65536)]
    max_tokens: int | None = Field(default=None, ge=1, le=32768, description="default 16, as OpenAI's")
    echo: bool = Field(default=False, description="not supported: omit or false")

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: str | list[int]) -> str | list[int]:
        if isinstance(v, list) and (not v or any(t < 0 for t in v)):
            raise ValueError("a token-id prompt must be a non-empty list of ids >= 0")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    finish_reason: Literal["stop", "length", "abort"] | None
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: Literal["stop", "length", "abort"] | None
    logprobs: None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "apiary"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """Every error the API returns, in the OpenAI shape so OpenAI clients show the message."""

    error: ErrorDetail


_Request.model_rebuild()
ChatCompletionRequest.model_rebuild()
CompletionRequest.model_rebuild()
