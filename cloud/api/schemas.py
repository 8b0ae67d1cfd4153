"""Request and response bodies of the OpenAI-compatible endpoints.

Everything the engine really does is accepted, with OpenAI's names and ranges: ``n``
(several choices of one prompt), ``seed``, ``stop``, ``logprobs`` / ``top_logprobs``
(chat) and ``logprobs`` (completions, OpenAI's legacy shape), presence / frequency
penalties, ``logit_bias``, ``response_format`` (``json_object``, ``json_schema``), and
vLLM's extensions (``top_k``, ``min_p``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``repetition_penalty``, ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar``). ``priority`` is our extension (vLLM has the same
name): 0 (most urgent) to 9, the scale of the mesh's ``InferenceRequest.priority`` and the
engine's scheduler.

Unknown fields are kept aside (``model_extra``), reported as ignored (a log line and the
``X-Apiary-Ignored-Fields`` header, see :func:`ignored_fields`) and never used, as vLLM
does; known fields keep their types and ranges. A ``null`` for a field with a default
means the default, as in OpenAI's API. Rules between fields (``top_logprobs`` needs
``logprobs``, one structured-output constraint at a time) are checked where the engine's
parameters are built, ``apiary.cloud.api.inference``.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Priority = Annotated[int, Field(ge=0, le=9, description="0 = most urgent, 9 = least (extension)")]
MAX_STOP = 4
MAX_PROMPT_CHARS = 200_000
MAX_N = 8  # choices per request: each is an engine request of its own
MAX_TOP_LOGPROBS = 20  # OpenAI's limit, and the engine's
MAX_GUIDE_CHARS = 64_000  # the engine's limit on a grammar / schema / regex
TokenId = Annotated[int, Field(ge=0)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]


class _Lenient(BaseModel):
    """Unknown fields are accepted and set aside (reported by :func:`ignored_fields`); ``null`` means the default."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        by_alias = {f.alias: name for name, f in fields.items() if f.alias}
        return {k: v for k, v in data.items()
                if v is not None or fields.get(by_alias.get(k, k)) is None
                or fields[by_alias.get(k, k)].default is None}


def ignored_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """Dotted paths of the unknown fields in ``model`` and the models inside it (``messages.0.foo``)."""
    names = [prefix + k for k in (model.model_extra or {})]
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            names += ignored_fields(value, f"{prefix}{name}.")
        elif isinstance(value, list):
            for j, item in enumerate(value):
                if isinstance(item, BaseModel):
                    names += ignored_fields(item, f"{prefix}{name}.{j}.")
    return names


class StreamOptions(_Lenient):
    include_usage: bool = Field(default=False, description="a last chunk with the usage and no choices")


class JsonSchemaFormat(_Lenient):
    name: str = Field(default="response", max_length=64)
    description: str | None = Field(default=None, max_length=MAX_GUIDE_CHARS)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema",
                                           description="the JSON schema; absent: any JSON object")
    strict: bool | None = Field(default=None, description="accepted; the schema is always enforced")


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(default=None, description="required for type json_schema")


class _Request(_Lenient):
    model: str | None = Field(default=None, max_length=256)
    max_tokens: int | None = Field(default=None, ge=1, le=32768)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N, description=f"choices, 1..{MAX_N}; choice i samples with seed + i")
    best_of: int | None = Field(default=None, ge=1, description="only equal to n (or absent)")
    stream: bool = False
    stream_options: StreamOptions | None = Field(default=None, description="only with stream=true")
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63 - MAX_N)
    user: str | None = Field(default=None, max_length=256)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: Annotated[dict[TokenId, Bias], Field(max_length=1024)] | None = Field(
        default=None, description="token id -> added to its logit, -100..100")
    response_format: ResponseFormat | None = None
    priority: Priority | None = None
    # vLLM's sampling extensions
    top_k: int = Field(default=0, ge=-1, description="0 or -1: off (vLLM extension)")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, description="vLLM extension")
    min_tokens: int = Field(default=0, ge=0, le=32768, description="end tokens masked until this many (vLLM)")
    ignore_eos: bool = Field(default=False, description="vLLM extension")
    stop_token_ids: Annotated[list[TokenId], Field(max_length=64)] | None = Field(default=None,
                                                                                 description="vLLM extension")
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0, description="vLLM extension")
    # vLLM's structured-output extensions (at most one of these and response_format)
    guided_json: dict[str, Any] | Annotated[str, Field(max_length=MAX_GUIDE_CHARS)] | None = Field(
        default=None, description="a JSON schema the output must follow (vLLM extension)")
    guided_regex: str | None = Field(default=None, min_length=1, max_length=MAX_GUIDE_CHARS,
                                     description="vLLM extension")
    guided_choice: Annotated[list[Annotated[str, Field(min_length=1, max_length=1024)]],
                             Field(min_length=1, max_length=256)] | None = Field(default=None,
                                                                                 description="vLLM extension")
    guided_grammar: str | None = Field(default=None, min_length=1, max_length=MAX_GUIDE_CHARS,
                                       description="EBNF (GBNF or Lark) (vLLM extension)")

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(not s or len(s) > 64 for s in stops):
            raise ValueError("stop sequences must be 1-64 characters")
        return stops


class TextPart(_Lenient):
    type: Literal["text"]
    text: str = Field(max_length=MAX_PROMPT_CHARS)


class ChatMessageIn(_Lenient):
    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)] | Annotated[list[TextPart], Field(max_length=256)]
    name: str | None = Field(default=None, max_length=64)

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessageIn] = Field(min_length=1, max_length=256)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=32768)
    logprobs: bool = Field(default=False, description="the chosen tokens' logprobs")
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS,
                                     description="alternatives per token; needs logprobs=true")
    tools: list[dict[str, Any]] | None = Field(default=None, description="not supported: omit or empty")
    functions: list[dict[str, Any]] | None = Field(default=None, description="not supported: omit or empty")
    tool_choice: str | dict[str, Any] | None = Field(default=None, description="only none or auto (no tools)")

    @model_validator(mode="after")
    def _max(self) -> "ChatCompletionRequest":
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


class CompletionRequest(_Request):
    prompt: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)] | Annotated[list[int], Field(max_length=65536)]
    max_tokens: int | None = Field(default=None, ge=1, le=32768, description="default 16, as OpenAI's")
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS,
                                 description="the chosen tokens' logprobs and this many alternatives")
    echo: bool = Field(default=False, description="not supported: omit or false")
    suffix: str | None = Field(default=None, description="not supported: omit or empty")

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: str | list[int]) -> str | list[int]:
        if isinstance(v, list) and (not v or any(t < 0 for t in v)):
            raise ValueError("a token-id prompt must be a non-empty list of ids >= 0")
        return v


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(default=0, description="prompt tokens served from the prefix cache")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float = Field(description="-9999.0 for a token the grammar ruled out")
    bytes: list[int] | None


class TokenLogprobOut(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobOut] | None
    refusal: list[TokenLogprobOut] | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    finish_reason: Literal["stop", "length", "abort"] | None
    logprobs: ChatLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy shape: per token its text, logprob, alternatives (text -> logprob) and character offset."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: Literal["stop", "length", "abort"] | None
    logprobs: CompletionLogprobs | None = None


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
    max_model_len: int | None = Field(default=None, description="context length, prompt + output tokens")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str  # the cause (validation_error, model_not_found, overloaded, …), always a string


class ErrorResponse(BaseModel):
    """Every error the API returns, in the OpenAI shape so OpenAI clients show the message."""

    error: ErrorDetail
