"""OpenAI request models (pydantic) and the error type every bad input becomes.

Unknown fields are ignored (clients send many optional ones); known fields are range-checked
here so the engine never sees an out-of-range sampling value.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
ROLES = ("system", "developer", "user", "assistant", "tool")


class APIError(Exception):
    """An error answered as OpenAI's `{"error": {message, type, param, code}}` body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class FunctionDef(_Strict):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDef


class ToolCallFunction(_Strict):
    name: str
    arguments: str | dict[str, Any] = ""


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ContentPart(_Strict):
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> ContentPart:
        if self.type != "text" or self.text is None:
            raise ValueError(f"content part type {self.type!r} is not supported (text only)")
        return self


class ChatMessage(_Strict):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, v: str) -> str:
        if v not in ROLES:
            raise ValueError(f"unknown role {v!r}; expected one of {', '.join(ROLES)}")
        return v

    def text(self) -> str | None:
        if isinstance(self.content, list):
            return "".join(p.text or "" for p in self.content)
        return self.content


class _Sampling(_Strict):
    """Fields shared by chat and completion requests, with OpenAI's (and vLLM's) ranges."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    n: int = Field(default=1, ge=1, le=1)
    stop: str | list[str] | None = Field(default=None, validate_default=True)
    stop_token_ids: list[int] | None = Field(default=None, max_length=64)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 16:
            raise ValueError(f"at most 16 stop strings, got {len(stops)}")
        for s in stops:
            if not s or len(s) > 256:
                raise ValueError(f"stop string {s!r} must have 1 to 256 characters")
        return stops


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    chat_template_kwargs: dict[str, Any] | None = None
    skip_special_tokens: bool = True

    @property
    def wanted_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    skip_special_tokens: bool = True
    max_tokens: int | None = Field(default=16, ge=1)

    @field_validator("prompt")
    @classmethod
    def _single_prompt(cls, v: Any) -> str | list[int]:
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError(f"batched prompts are not supported ({len(v)} given); send one per request")
            v = v[0]
        if isinstance(v, (str, list)) and len(v) == 0:
            raise ValueError("prompt is empty")
        return v

    @property
    def wanted_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


def _field_names(*models: type[BaseModel]) -> frozenset[str]:
    """Every field name of the request models (to tell field names from union tags in error paths)."""
    return frozenset(name for m in models for name in m.model_fields)


FIELD_NAMES = _field_names(ChatCompletionRequest, CompletionRequest, ChatMessage, ContentPart, Tool, FunctionDef,
                           ToolCall, ToolCallFunction, StreamOptions)
