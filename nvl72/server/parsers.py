"""Streaming output parsers for Qwen models: stop strings, `<think>` reasoning, `<tool_call>` JSON.

Each takes text deltas and returns what can be released now, holding back a tail that might be
the start of a marker split across deltas; `finish()` releases the rest. Feeding the whole text at
once and feeding it character by character give the same result.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

THINK_START, THINK_END = "<think>", "</think>"
TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest proper prefix of `marker` that `text` ends with."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class StopStrings:
    """Cuts the output at the first stop string (not included), holding back a possible partial one."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._buf = ""
        self.stopped = False

    def feed(self, delta: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return delta
        self._buf += delta
        hits = [i for i in (self._buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self._buf, self.stopped = self._buf[:min(hits)], "", True
            return out
        cut = len(self._buf) - self._hold
        if cut <= 0:
            return ""
        out, self._buf = self._buf[:cut], self._buf[cut:]
        return out

    def finish(self) -> str:
        out, self._buf = self._buf, ""
        return "" if self.stopped else out


class ReasoningParser:
    """Splits `<think>reasoning</think>content`. `started=True` when the prompt already opened the
    think block (the output then begins inside it). Newlines right after either tag are dropped,
    as the Qwen chat template writes them."""

    def __init__(self, started: bool = False):
        self._state = "reasoning" if started else "start"
        self._buf = ""
        self._lstrip = started

    def feed(self, delta: str) -> tuple[str, str]:
        """-> (reasoning delta, content delta)."""
        self._buf += delta
        reasoning, content = "", ""
        while True:
            if self._state == "start":
                head = self._buf.lstrip()
                if head.startswith(THINK_START):
                    self._buf, self._state, self._lstrip = head[len(THINK_START):], "reasoning", True
                    continue
                if THINK_START.startswith(head):  # could still become "<think>"
                    return reasoning, content
                self._state = "content"
            if self._lstrip:
                self._buf = self._buf.lstrip("\n")
                if not self._buf:
                    return reasoning, content
                self._lstrip = False
            if self._state == "content":
                content += self._buf
                self._buf = ""
                return reasoning, content
            i = self._buf.find(THINK_END)
            if i >= 0:
                reasoning += self._buf[:i]
                self._buf, self._state, self._lstrip = self._buf[i + len(THINK_END):], "content", True
                continue
            keep = _partial_suffix(self._buf, THINK_END)
            reasoning += self._buf[:len(self._buf) - keep]
            self._buf = self._buf[len(self._buf) - keep:]
            return reasoning, content

    def finish(self) -> tuple[str, str]:
        buf, self._buf = self._buf, ""
        return (buf, "") if self._state == "reasoning" else ("", buf)


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: int | None = None) -> dict:
        d = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            d["index"] = index
        return d


def _parse_call(body: str) -> ParsedToolCall | None:
    """`{"name": ..., "arguments": {...}}` -> a call; None if it is not one."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ParsedToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


class ToolCallParser:
    """Extracts Qwen `<tool_call>{json}</tool_call>` blocks from content. A block whose body is not
    a call object is passed through as text. Whitespace before a call or at the end is dropped
    when the output has calls."""

    def __init__(self):
        self._buf = ""
        self._in_call = False
        self._pending_ws = ""
        self.calls: list[ParsedToolCall] = []

    def _text(self, s: str) -> str:
        """Hold trailing whitespace until real text follows (so newlines around calls vanish)."""
        s = self._pending_ws + s
        body = s.rstrip()
        self._pending_ws = s[len(body):]
        return body

    def feed(self, delta: str) -> tuple[str, list[ParsedToolCall]]:
        """-> (content delta, calls completed by this delta)."""
        self._buf += delta
        text, calls = "", []
        while True:
            if self._in_call:
                i = self._buf.find(TOOL_END)
                if i < 0:
                    return text, calls
                body, self._buf, self._in_call = self._buf[:i], self._buf[i + len(TOOL_END):], False
                call = _parse_call(body.strip())
                if call is None:
                    text += self._text(TOOL_START + body + TOOL_END)
                else:
                    calls.append(call)
                    self.calls.append(call)
                continue
            i = self._buf.find(TOOL_START)
            if i >= 0:
                text += self._text(self._buf[:i])
                self._buf, self._in_call = self._buf[i + len(TOOL_START):], True
                continue
            keep = _partial_suffix(self._buf, TOOL_START)
            text += self._text(self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return text, calls

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        """End of output: an unterminated block becomes a call if its body parses, else text."""
        buf, self._buf = self._buf, ""
        if self._in_call:
            self._in_call = False
            call = _parse_call(buf.strip())
            if call is not None:
                self.calls.append(call)
                return "", [call]
            buf = TOOL_START + buf
        out = self._pending_ws + buf
        self._pending_ws = ""
        return ("" if self.calls and not out.strip() else out), []
