"""Tool calling in /v1/chat/completions, as SGLang's `--tool-call-parser` and vLLM's tool parsers give it.

A request's `tools`, `tool_choice` and `parallel_tool_calls` are checked (`tool_request`); the tools
reach the target's chat template as Hugging Face's `apply_chat_template(messages, tools=...)` passes
them; the calls the model writes are parsed out of its text in the format of its family, piece by
piece as the text streams (`ChoiceCalls`: a whole response goes through the same parser in one piece,
so a stream's deltas add up to the whole response); a forced `tool_choice` ("required", or a named
function) is an llguidance grammar (`ToolRequest.lark`) that writes that format, the arguments following
the function's `parameters` schema.

    family                  the model writes                                          --tool-call-parser
    Llama 3.x (JSON calls)  {"name": "f", "parameters": {...}}  at the start of its   llama3
                            answer or after <|python_tag|>; several joined by "; "
    Qwen2.5 / Qwen3 /       <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>  qwen25, hermes
    Hermes                  (a block a call)

Text that does not parse as a call of one of the request's functions stays content, as it was.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import uuid
from typing import NamedTuple

from jeagle.serve.protocol import BadRequest, grammar_request

PARSERS = ("auto", "llama3", "qwen25", "hermes", "none")  # --tool-call-parser's choices

# A forced call's arguments: JSON as the templates write it (`tojson`: ", " and ": "), no free whitespace
# (a model could pad it forever). A schema's own "x-guidance" options win.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


class Call(NamedTuple):
    name: str
    arguments: str  # JSON text


# ---- parsing the model's text ---------------------------------------------------------------------------
def as_call(obj, names) -> Call | None:
    """A parsed JSON value as a call of one of `names`: {"name", "arguments" or "parameters": an object
    (or a string holding one; absent: {})}, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return Call(obj["name"], json.dumps(args, ensure_ascii=False)) if isinstance(args, dict) else None


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _partial(text: str, marker: str) -> int:
    """The length of the longest tail of `text` that starts `marker` (held back: it may become one)."""
    return next((k for k in range(min(len(marker) - 1, len(text)), 0, -1) if text.endswith(marker[:k])), 0)


class _Calls:
    """One choice's text → events: content (str) and calls (`Call`), as the text arrives (`push`) and
    at its end (`finish`). Whitespace next to a call is not content (it is held back until the next
    text shows which it is); the rest of the text outside calls is, unchanged."""

    def __init__(self, names):
        self.names, self.buf, self.ws, self.calls, self.after_call = frozenset(names), "", "", 0, False

    def push(self, text: str) -> list:
        self.buf += text
        return self._scan(False)

    def finish(self) -> list:
        return self._scan(True)

    def _text(self, out: list, text: str, final: bool = False) -> None:
        if self.after_call:
            text = text.lstrip()
            if not text:
                return
            self.after_call = False
        text = self.ws + text
        body = text.rstrip() if not final or self.calls else text
        self.ws = "" if final else text[len(body):]
        if body:
            out.append(body)

    def _call(self, out: list, obj) -> bool:
        call = as_call(obj, self.names)
        if call is None:
            return False
        self.ws, self.after_call, self.calls = "", True, self.calls + 1
        out.append(call)
        return True

    def _scan(self, final: bool) -> list:
        raise NotImplementedError


class HermesCalls(_Calls):
    """Qwen2.5 / Qwen3 / Hermes: each call a `<tool_call>` block holding {"name", "arguments"}; a block
    the answer ends inside (no `</tool_call>`) is read as far as it goes."""
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, names):
        super().__init__(names)
        self.inside = False

    def _scan(self, final: bool) -> list:
        out = []
        while True:
            if not self.inside:
                i = self.buf.find(self.OPEN)
                if i < 0:
                    keep = 0 if final else _partial(self.buf, self.OPEN)
                    self._text(out, self.buf[:len(self.buf) - keep], final)
                    self.buf = self.buf[len(self.buf) - keep:]
                    return out
                self._text(out, self.buf[:i])
                self.buf, self.inside = self.buf[i + len(self.OPEN):], True
            j = self.buf.find(self.CLOSE)
            if j < 0 and not final:
                return out
            block, rest = (self.buf[:j], self.buf[j + len(self.CLOSE):]) if j >= 0 else (self.buf, "")
            self.buf, self.inside = rest, False
            if not self._call(out, _loads(block.strip())):
                self._text(out, self.OPEN + block + (self.CLOSE if j >= 0 else ""))


class Llama3Calls(_Calls):
    """Llama 3.x's JSON calls: {"name", "parameters"} objects at the start of the answer or after
    `<|python_tag|>` (a special token: it reaches the text only where the tokenizer keeps it), several
    joined by ";". A JSON object that is not a call, or text that does not close one, is content."""
    TAG = "<|python_tag|>"
    OBJECT = re.compile(r'\{\s*(?:"|$)')  # what a call's text starts with (a key, or nothing yet)

    def __init__(self, names):
        super().__init__(names)
        self.state, self.lead = "start", ""  # lead: what came before the call being read (content if it fails)

    def _scan(self, final: bool) -> list:
        out = []
        while True:
            body = self.buf.lstrip()
            if self.state == "start":  # only whitespace so far
                if body.startswith("{"):
                    self.state = "call"
                elif body.startswith(self.TAG):
                    cut = len(self.buf) - len(body) + len(self.TAG)
                    self.lead, self.buf, self.state = self.buf[:cut], self.buf[cut:], "call"
                elif not final and (not body or self.TAG.startswith(body)):
                    return out
                else:
                    self.state = "text"
            elif self.state == "text":
                i = self.buf.find(self.TAG)
                if i < 0:
                    keep = 0 if final else _partial(self.buf, self.TAG)
                    self._text(out, self.buf[:len(self.buf) - keep], final)
                    self.buf = self.buf[len(self.buf) - keep:]
                    return out
                self._text(out, self.buf[:i])
                self.lead, self.buf, self.state = self.TAG, self.buf[i + len(self.TAG):], "call"
            elif self.state == "call":
                if not body and final:  # a dangling tag or separator
                    self.buf = self.lead = ""
                    return out
                if not body or (self.OBJECT.match(body) and "}" not in body and not final):
                    return out
                obj, end = None, len(body)
                if self.OBJECT.match(body):
                    try:
                        obj, end = json.JSONDecoder().raw_decode(body)
                    except ValueError:
                        if not final:
                            return out
                used = len(self.buf) - len(body) + end
                if obj is None or not self._call(out, obj):
                    self._text(out, self.lead + self.buf[:used])
                    self.state = "text"
                else:
                    self.state = "sep"
                self.buf, self.lead = self.buf[used:], ""
            else:  # "sep": after a call, ";" and the next call, or the end, or text
                if body.startswith(";"):
                    cut = len(self.buf) - len(body) + 1
                    self.lead, self.buf, self.state = self.buf[:cut], self.buf[cut:], "call"
                elif body or final:
                    self.state = "text"
                else:
                    return out


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family's call format: how its text is parsed, and what a forced call writes."""
    name: str
    parser: type
    key: str  # the arguments' key in a call's object
    open: str  # before each forced call ...
    close: str  # ... after it ...
    sep: str  # ... and between two


HERMES = Family("hermes", HermesCalls, "arguments", "<tool_call>\n", "\n</tool_call>", "\n")
LLAMA3 = Family("llama3", Llama3Calls, "parameters", "", "", "; ")


def resolve(option: str, chat_template: str | None) -> Family | None:
    """--tool-call-parser's family; "auto": the one the chat template writes calls in (None: the
    template has no tool calls of a known family, and tools are rendered but not parsed)."""
    if option == "none":
        return None
    if option != "auto":
        return {"llama3": LLAMA3, "qwen25": HERMES, "hermes": HERMES}[option]
    t = chat_template or ""
    if "<tool_call>" in t:
        return HERMES
    if "<|python_tag|>" in t or ("<|start_header_id|>" in t and '"parameters"' in t):
        return LLAMA3
    return None


class ChoiceCalls:
    """One choice's content and tool calls, piece by piece: `push(text, finish)` → (content, the calls
    completed, each as a stream delta's entry, finish_reason: "tool_calls" for a choice that called)."""

    def __init__(self, family: Family, names):
        self.parser, self.count = family.parser(names), 0

    def push(self, text: str, finish: str | None) -> tuple[str, list[dict], str | None]:
        events = self.parser.push(text) if text else []
        if finish is not None:
            events += self.parser.finish()
        content, calls = [], []
        for e in events:
            if isinstance(e, Call):
                calls.append({"index": self.count, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                              "function": {"name": e.name, "arguments": e.arguments}})
                self.count += 1
            else:
                content.append(e)
        return "".join(content), calls, "tool_calls" if finish == "stop" and self.count else finish

    def whole(self, text: str, finish: str | None) -> tuple[str, list[dict], str | None]:
        """A whole response's (its message's calls have no index)."""
        content, calls, _ = self.push(text, "stop")
        return (content, [{k: v for k, v in c.items() if k != "index"} for c in calls],
                "tool_calls" if finish == "stop" and calls else finish)


# ---- the request ------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ToolRequest:
    tools: list  # checked, in OpenAI's shape (what the chat template gets)
    choice: str  # "none", "auto", "required", or the name of the function it must call
    parallel: bool  # "required": one call or more (False: one)
    family: Family | None  # the server's (None: no parsing)

    @property
    def rendered(self) -> list | None:
        """The tools the template renders ("none": none, so the model cannot call)."""
        return None if self.choice == "none" else self.tools

    @property
    def forced(self) -> bool:
        return self.choice not in ("none", "auto")

    def output(self) -> ChoiceCalls | None:
        """A choice's parser (None: nothing parsed)."""
        if self.family is None or self.choice == "none":
            return None
        return ChoiceCalls(self.family, [t["function"]["name"] for t in self.tools])

    def lark(self) -> str:
        """The forced choice's llguidance (Lark) grammar: the family's call text with the name fixed
        and the arguments a JSON value of the function's schema; "required": any tool, one call or
        more (one without parallel calls); a named function: exactly one call of it."""
        f = self.family
        fns = [t["function"] for t in self.tools if self.choice == "required" or t["function"]["name"] == self.choice]
        rules = []
        for k, fn in enumerate(fns):
            schema = {"type": "object"} | (fn.get("parameters") or NO_PARAMETERS)  # a call's arguments: an object
            own = schema.get("x-guidance")
            schema["x-guidance"] = JSON_STYLE | (own if isinstance(own, dict) else {})
            head = '{"name": ' + json.dumps(fn["name"], ensure_ascii=False) + f', "{f.key}": '
            rules.append(f'fn{k}: {json.dumps(head)} %json {json.dumps(schema)} "}}"')
        call = " ".join(x for x in (f.open and json.dumps(f.open), "(" + " | ".join(f"fn{k}" for k in range(len(fns)))
                                    + ")", f.close and json.dumps(f.close)) if x)
        many = self.choice == "required" and self.parallel
        return "\n".join([f"start: call ({json.dumps(f.sep)} call)*" if many else "start: call", f"call: {call}",
                          *rules])


def constrain(tools: ToolRequest | None, params, grammar):
    """`params` with a forced tool choice's grammar, compiled by `grammar(kind, source, param)` (the
    server's); other requests' unchanged."""
    if tools is None or not tools.forced:
        return params
    return dataclasses.replace(params, grammar=grammar("lark", tools.lark(), "tool_choice"))


def tool_request(body: dict, family: Family | None) -> ToolRequest | None:
    """A chat request's tools, tool_choice and parallel_tool_calls, checked (None: no tools)."""
    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise BadRequest("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if tools is None:
        if choice not in (None, "none"):
            raise BadRequest("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list) or not tools:
        raise BadRequest("'tools' must be a non-empty list of {\"type\": \"function\", \"function\": {...}}", "tools")
    checked = [_tool(i, t) for i, t in enumerate(tools)]
    names = [t["function"]["name"] for t in checked]
    twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if twice is not None:
        raise BadRequest(f"'tools' names function {twice!r} twice", "tools")
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRequest("'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                             "\"function\": {\"name\": ...}}", "tool_choice")
        if fn["name"] not in names:
            raise BadRequest(f"'tool_choice' names function {fn['name']!r}, which is not in 'tools'", "tool_choice")
        choice = fn["name"]
    elif choice not in ("none", "auto", "required"):
        raise BadRequest("'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                         "\"function\": {\"name\": ...}}", "tool_choice")
    out = ToolRequest(checked, choice, parallel is not False, family)
    if out.forced:
        if family is None:
            raise BadRequest("a forced 'tool_choice' needs a tool-call format: this server has none for its model "
                             "(--tool-call-parser)", "tool_choice")
        if grammar_request(body) is not None:
            given = next(k for k in ("response_format", "regex", "ebnf") if body.get(k) is not None)
            raise BadRequest(f"'{given}' cannot be combined with a forced 'tool_choice'", given)
        for i, t in enumerate(checked):  # what the grammar enforces, all of it
            if choice in ("required", t["function"]["name"]):
                _check_schema(i, t["function"].get("parameters"), lenient=False)
    return out


def _tool(i: int, tool) -> dict:
    where = f"tools[{i}]"
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
        raise BadRequest(f"'{where}' must be {{\"type\": \"function\", \"function\": {{\"name\", \"description\", "
                         "\"parameters\"}} (function tools only)", "tools")
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise BadRequest(f"'{where}.function.name' must be a non-empty string", "tools")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise BadRequest(f"'{where}.function.description' must be a string", "tools")
    params = fn.get("parameters")
    if params is not None and (not isinstance(params, dict) or params.get("type", "object") != "object"):
        raise BadRequest(f"'{where}.function.parameters' must be a JSON schema of an object", "tools")
    _check_schema(i, params, lenient=True)
    return {"type": "function", "function": {k: v for k, v in fn.items() if v is not None}}


def _check_schema(i: int, schema: dict | None, lenient: bool) -> None:
    """A tool's `parameters` as llguidance compiles them. `lenient`: keywords it does not implement are
    let through (nothing is enforced unless tool_choice forces a call, and then they are an error)."""
    if schema is not None:
        error = _schema_error(json.dumps(schema, sort_keys=True), lenient)
        if error:
            raise BadRequest(f"'tools[{i}].function.parameters' is not a usable JSON schema: {error}", "tools")


@functools.lru_cache(maxsize=256)
def _schema_error(schema: str, lenient: bool) -> str:
    try:
        import llguidance
    except ImportError:  # nothing to check with: a forced choice then fails where its grammar is compiled
        return ""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides={"lenient": lenient})
    except ValueError as e:
        return " ".join(str(e).split())
    error = llguidance.LLMatcher.validate_grammar(grammar)
    return "" if not error or error.startswith("WARNING") else " ".join(error.split())


@functools.lru_cache(maxsize=64)
def lark_grammar(backend, lark: str):
    """A forced tool choice's grammar (`ToolRequest.lark`) on the server's `GrammarBackend`, checked
    against its vocabulary (raises GrammarError); the engine's process rebuilds it from its text."""
    import llguidance

    from jeagle.sampling.grammar import GrammarError

    text = llguidance.LLMatcher.grammar_from_lark(lark)
    error = llguidance.LLMatcher.validate_grammar(text, backend.tokenizer)
    if error and not error.startswith("WARNING"):
        raise GrammarError("tool_choice: " + " ".join(error.split()))
    return backend.rebuild("lark", text)
