"""Tool calling in /v1/chat/completions (`jeagle.serve.tools`): the Llama 3.x and Qwen2.5 / Hermes
parsers (whole and streamed, text around calls, malformed calls left as content, a marker's start held
back), tools and tool messages rendered by chat templates in the style of Qwen2.5's and Llama 3.1's,
forced tool choices written by a grammar (arguments valid under the function's schema, EAGLE's greedy
output equal to target-only decoding's), and the 400s. A tiny fp32 bigram target, a character
tokenizer covering printable ASCII."""

from __future__ import annotations

import json

import httpx
import pytest
jsonschema = pytest.importorskip("jsonschema")

from jeagle.engine import EngineConfig, speculative
from jeagle.serve.protocol import BadRequest, chat_prompt_ids
from jeagle.serve.tools import HERMES, LLAMA3, Call, ChoiceCalls, HermesCalls, Llama3Calls, resolve, tool_request
from jeagle.speculative.round import SpecConfig
from tests.spec_models import bigram_target, signed_identity_head, target_config
from tests.test_serve import TEMPLATE, char_tokenizer, start_server

VOCAB, EOS, MODEL = 100, 3, "tiny-tools"

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 4}}, "required": ["zone"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "clock", "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "clock": CLOCK}

# Qwen2.5's shape, shorter: the tools in a system turn, each call a <tool_call> block whose arguments the
# template writes with tojson, tool results as <tool_response> in a user turn.
QWEN_STYLE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{{ m.content }}"
    "{% for c in m.tool_calls %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Llama 3.1's shape: the tools as JSON in the user turn, one call as {"name", "parameters"}, results as ipython.
LLAMA_STYLE = (
    "{% for m in messages %}<|start_header_id|>{{ 'ipython' if m.role == 'tool' else m.role }}<|end_header_id|>\n\n"
    "{% if m.role == 'user' and tools %}{% for t in tools %}{{ t | tojson(indent=4) }}\n{% endfor %}{% endif %}"
    "{% if m.tool_calls %}{% set c = m.tool_calls[0].function %}"
    "{{ '{\"name\": \"' + c.name + '\", \"parameters\": ' }}{{ c.arguments | tojson }}}"
    "{% else %}{{ m.content }}{% endif %}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")

HISTORY = [{"role": "user", "content": "Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]


def events(parser_type, text: str, step: int | None = None, names=("get_weather", "clock")) -> list:
    """The parser's events for `text` pushed `step` characters at a time (None: at once), adjacent
    content joined."""
    p, out = parser_type(names), []
    for i in range(0, len(text), step or max(1, len(text))):
        out += p.push(text[i:i + (step or len(text))])
    out += p.finish()
    joined = []
    for e in out:
        if isinstance(e, str) and joined and isinstance(joined[-1], str):
            joined[-1] += e
        else:
            joined.append(e)
    return joined


def same_in_every_chunking(parser_type, text: str) -> list:
    whole = events(parser_type, text)
    for step in (1, 2, 3, 5, 11):
        assert events(parser_type, text, step) == whole, (text, step)
    return whole


W = Call("get_weather", '{"city": "Paris", "days": 2}')


@pytest.mark.parametrize("text,want", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>', [W]),
    ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
     '<tool_call>\n{"name": "clock", "arguments": {"zone": "CET"}}\n</tool_call>',
     ["Let me look.", W, Call("clock", '{"zone": "CET"}')]),
    ('a <tool_call>{"name": "clock", "arguments": "{\\"zone\\": \\"UTC\\"}"}</tool_call>\n\nthen b',
     ["a", Call("clock", '{"zone": "UTC"}'), "then b"]),  # arguments as a JSON string
    ('<tool_call>\n{"name": "clock", "arguments": {"zone": "X"}}\n', [Call("clock", '{"zone": "X"}')]),  # unclosed
    ('x <tool_call>{"name": "clock", "arguments": {"zone": }}</tool_call> y',  # malformed JSON: content
     ['x <tool_call>{"name": "clock", "arguments": {"zone": }}</tool_call> y']),
    ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', ['<tool_call>{"name": "rm_rf", "arguments": {}}'
                                                                   '</tool_call>']),  # not a tool of the request
    ('<tool_call>{"name": "clock", "arguments": {"zone": "X"', ['<tool_call>{"name": "clock", "arguments": '
                                                               '{"zone": "X"']),  # cut off
    ("plain text, no calls\n\n ", ["plain text, no calls\n\n "]),
    ("the tag <tool_ca", ["the tag <tool_ca"]),
])
def test_hermes_parser(text, want):
    assert same_in_every_chunking(HermesCalls, text) == want


@pytest.mark.parametrize("text,want", [
    ('{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}', [W]),
    ('{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; {"name": "clock", "parameters": '
     '{"zone": "CET"}}', [W, Call("clock", '{"zone": "CET"}')]),
    ('  <|python_tag|>{"name": "clock", "arguments": {"zone": "X"}}', [Call("clock", '{"zone": "X"}')]),
    ('Sure. <|python_tag|>{"name": "clock", "parameters": {}} Done.', ["Sure.", Call("clock", "{}"), "Done."]),
    ('{"city": "Paris"} is JSON, not a call', ['{"city": "Paris"} is JSON, not a call']),
    ('Here: {"name": "clock", "parameters": {}}', ['Here: {"name": "clock", "parameters": {}}']),  # not at the start
    ('{not json', ["{not json"]),
    ('{"name": "clock", "parameters": {"zone": "X"', ['{"name": "clock", "parameters": {"zone": "X"']),
    ('<|python_tag|>weather.call(city="Paris")', ['<|python_tag|>weather.call(city="Paris")']),
    ("  just words", ["  just words"]),
])
def test_llama3_parser(text, want):
    assert same_in_every_chunking(Llama3Calls, text) == want


def test_a_possible_marker_is_held_back_until_known():
    p = HermesCalls(["clock"])
    assert p.push("Checking <tool") == ["Checking"]  # the space too: whitespace before a call is not content
    assert p.push("_c") == []
    assert p.push("all>\n{\"name\": \"clock\", \"argu") == []
    assert p.push('ments": {}}\n</tool_call>') == [Call("clock", "{}")]
    assert p.push("\n<tool") == [] and p.push("bar> ok") == ["<toolbar> ok"] and p.finish() == []
    q = Llama3Calls(["clock"])
    assert q.push("  ") == [] and q.push("<|py") == [] and q.push("thon_tag|>{") == []
    assert q.push('"name": "clock", "parameters": {}}') == [Call("clock", "{}")]
    r = Llama3Calls(["clock"])
    assert r.push("Hi there") == ["Hi there"]  # not a call's start: content at once


def test_choice_calls_give_ids_indices_and_finish_reason():
    c = ChoiceCalls(HERMES, ["clock"])
    text, calls, finish = c.push('<tool_call>{"name": "clock", "arguments": {}}</tool_call>', None)
    assert text == "" and finish is None and calls[0]["index"] == 0 and calls[0]["id"].startswith("call_")
    assert calls[0]["type"] == "function" and calls[0]["function"] == {"name": "clock", "arguments": "{}"}
    text, more, finish = c.push('<tool_call>{"name": "clock", "arguments": {}}</tool_call>', "stop")
    assert more[0]["index"] == 1 and more[0]["id"] != calls[0]["id"] and finish == "tool_calls"
    content, calls, finish = ChoiceCalls(LLAMA3, ["clock"]).whole("no call", "stop")
    assert (content, calls, finish) == ("no call", [], "stop")
    _, calls, finish = ChoiceCalls(LLAMA3, ["clock"]).whole('{"name": "clock", "parameters": {}}', "length")
    assert "index" not in calls[0] and finish == "length"


def test_auto_picks_the_family_from_the_chat_template():
    assert resolve("auto", QWEN_STYLE) is HERMES and resolve("auto", LLAMA_STYLE) is LLAMA3
    assert resolve("auto", TEMPLATE) is None and resolve("auto", None) is None
    assert resolve("qwen25", TEMPLATE) is HERMES and resolve("hermes", None) is HERMES
    assert resolve("llama3", QWEN_STYLE) is LLAMA3 and resolve("none", QWEN_STYLE) is None


@pytest.mark.parametrize("template", [QWEN_STYLE, LLAMA_STYLE])
def test_templates_render_tools_calls_and_results(template):
    tok = char_tokenizer("~")
    tok.chat_template = template
    body = {"messages": HISTORY, "tools": TOOLS}
    req = tool_request(body, resolve("auto", template))
    text = tok.decode(chat_prompt_ids(body, tok, req.rendered), skip_special_tokens=False)
    key = "arguments" if template is QWEN_STYLE else "parameters"
    # The call's arguments reach the template as a mapping: tojson writes an object, not a quoted string.
    assert '{"name": "get_weather", "' + key + '": {"city": "Paris", "days": 2}}' in text
    assert '{"temp": 21}' in text and "clock" in text
    if template is LLAMA_STYLE:
        assert json.dumps(TOOLS[0], indent=4) in text and "<|start_header_id|>ipython" in text
    else:
        assert "<tool_response>\n{\"temp\": 21}\n</tool_response>" in text and "Tools: get_weather clock" in text
    none = tool_request(body | {"tool_choice": "none"}, HERMES)
    assert "clock" not in tok.decode(chat_prompt_ids(body, tok, none.rendered), skip_special_tokens=False)


def test_the_forced_grammar_writes_the_family_format():
    from jeagle.sampling.grammar import GrammarBackend
    from jeagle.serve.tools import lark_grammar

    tok = char_tokenizer("~")
    backend = GrammarBackend(tok, VOCAB, EOS)

    def accepts(req, text):
        m = lark_grammar(backend, req.lark()).matcher().ll
        ids = tok.encode(text, add_special_tokens=False)
        return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()

    one = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}\n</tool_call>'
    two = one + '\n<tool_call>\n{"name": "clock", "arguments": {"zone": "UTC"}}\n</tool_call>'
    required = tool_request({"tools": TOOLS, "tool_choice": "required"}, HERMES)
    assert accepts(required, one) and accepts(required, two)
    assert not accepts(required, one.replace('"days": 3', '"days": 9'))  # outside the schema
    assert not accepts(required, one.replace('"Rome", ', '"Rome",'))  # the templates' JSON spacing only
    single = tool_request({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}, HERMES)
    assert accepts(single, one) and not accepts(single, two)
    named = tool_request({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "clock"}}}, HERMES)
    assert not accepts(named, one) and accepts(named, two[len(one) + 1:])
    llama = tool_request({"tools": TOOLS, "tool_choice": "required"}, LLAMA3)
    assert accepts(llama, '{"name": "clock", "parameters": {"zone": "A"}}; '
                          '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 1}}')
    no_params = tool_request({"tools": [{"type": "function", "function": {"name": "ping"}}], "tool_choice": "required"},
                             LLAMA3)
    assert accepts(no_params, '{"name": "ping", "parameters": {}}')


# ---- over HTTP, EAGLE on ------------------------------------------------------------------------------------
# One prefill bucket, one KV bucket, one batch bucket: few executables to compile.
# Llama 3.1's template writes the tools as indented JSON into the user turn: ~1,200 characters of this tokenizer.
CONTEXT = {"qwen": 256, "llama": 2048}


def config(family: str) -> EngineConfig:
    n = CONTEXT[family]
    return EngineConfig(max_batch_size=1, max_context=n, min_prefill_bucket=n, min_kv_bucket=n, prefix_cache=False)


@pytest.fixture(scope="module", params=["qwen", "llama"])
def parts(request):
    """The over-HTTP tests run once with each family's template (--tool-call-parser auto picks its format)."""
    target = bigram_target(target_config(vocab=VOCAB, eos=(EOS,)), scale=6.0)
    tok = char_tokenizer("~")
    tok.chat_template = QWEN_STYLE if request.param == "qwen" else LLAMA_STYLE
    return target, signed_identity_head(target, +1.0, noise=0.05), tok, request.param


@pytest.fixture(scope="module")
def server(parts):
    from jeagle.serve import create_app

    target, head, tok, family = parts
    engine = speculative(target, head, config(family), SpecConfig(3, 2, 5))
    srv, thread, url = start_server(create_app(engine, tok, MODEL))  # --tool-call-parser auto: the template's
    yield url
    srv.should_exit = True
    thread.join(timeout=30)


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server}/v1", api_key="unused")


@pytest.fixture(scope="module")
def reference(parts):
    """Greedy target-only decoding of a chat body under its forced tool choice, by hand → (content, calls,
    finish_reason). The bigram target's next token is a function of the current one (its attention and
    MLP write nothing), so one forward over every token gives its logits after each; the grammar's mask
    is applied to them token by token."""
    import numpy as np

    from jeagle.sampling.grammar import GrammarBackend
    from jeagle.serve.tools import lark_grammar
    from tests.util import ragged_forward

    target, _, tok, _ = parts
    backend = GrammarBackend(tok, VOCAB, EOS)
    after = ragged_forward(target, [list(range(VOCAB))])[0][0]  # [token, next token's logits]
    ids = np.arange(VOCAB)

    family = resolve("auto", tok.chat_template)

    def run(body, max_tokens):
        req = tool_request(body, family)
        prompt, out = chat_prompt_ids(body, tok, req.rendered), []
        m = lark_grammar(backend, req.lark()).matcher()
        while len(out) < max_tokens and (not out or out[-1] != EOS):
            allowed = (m.mask()[ids // 32] >> (ids % 32)) & 1
            out.append(int(np.argmax(np.where(allowed, after[(prompt + out)[-1]], -np.inf))))
            if out[-1] != EOS:
                m.consume(out[-1])
        stop = out[-1] == EOS
        return req.output().whole(tok.decode(out[:-1] if stop else out), "stop" if stop else "length")
    return run


def check_calls(calls, names):
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_") and c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def test_a_named_tool_choice_is_called_and_equals_target_only(client, reference):
    messages = [{"role": "user", "content": "Weather in Rome?"}]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice=choice,
                                       temperature=0, max_tokens=120)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None and len(c.message.tool_calls) == 1
    check_calls(c.message.tool_calls, {"get_weather"})
    content, calls, finish = reference({"messages": messages, "tools": TOOLS, "tool_choice": choice}, 120)
    assert (content, finish) == ("", "tool_calls")
    assert [(x["function"]["name"], x["function"]["arguments"]) for x in calls] == \
        [(x.function.name, x.function.arguments) for x in c.message.tool_calls]  # EAGLE == target-only


def test_required_streamed_adds_up_to_the_whole_response(client, reference):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What time is it?"}]
    kw = dict(model=MODEL, messages=messages, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
              temperature=0, max_tokens=120)
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and len(whole.message.tool_calls) == 1
    check_calls(whole.message.tool_calls, {"get_weather", "clock"})
    content, calls, _ = reference({k: v for k, v in kw.items() if k in ("messages", "tools", "tool_choice",
                                                                           "parallel_tool_calls")}, 120)
    assert [x["function"]["arguments"] for x in calls] == [whole.message.tool_calls[0].function.arguments]
    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [d for ch in chunks for d in (ch.choices[0].delta.tool_calls or [])]
    assert [d.index for d in deltas] == [0] and deltas[0].id.startswith("call_") and deltas[0].type == "function"
    assert (deltas[0].function.name, deltas[0].function.arguments) == (whole.message.tool_calls[0].function.name,
                                                                       whole.message.tool_calls[0].function.arguments)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == ""
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices[0].finish_reason] == ["tool_calls"]


def test_auto_and_none_with_a_tool_history(client):
    """A conversation with an assistant's call (content null) and its tool result; auto renders the tools,
    none does not (fewer prompt tokens); text that is no call stays content, streamed as whole."""
    kw = dict(model=MODEL, messages=HISTORY, tools=TOOLS, temperature=0, max_tokens=16)
    auto = client.chat.completions.create(**kw)
    none = client.chat.completions.create(**kw, tool_choice="none")
    assert none.usage.prompt_tokens < auto.usage.prompt_tokens
    for r in (auto, none):
        assert r.choices[0].finish_reason in ("stop", "length") and not r.choices[0].message.tool_calls
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == auto.choices[0].message.content


@pytest.mark.parametrize("extra,param", [
    ({"tools": "get_weather"}, "tools"),
    ({"tools": []}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": TOOLS, "tool_choice": "required", "regex": "a+"}, "regex"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "if": {}}}}],
      "tool_choice": "required"}, "tools"),  # a keyword llguidance cannot enforce: fine for auto, not forced
    ({"messages": [{"role": "tool", "content": "21"}]}, "messages"),  # no tool_call_id
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": None}]}, "messages"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
])
def test_bad_tool_requests_are_400(server, extra, param):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4} | extra
    with httpx.Client(base_url=server, timeout=60) as c:
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"], err
        ok = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                  "tools": TOOLS, "tool_choice": "auto", "temperature": 0})
        assert ok.status_code == 200


def test_a_forced_choice_without_a_format_is_400_and_lenient_schemas_pass_for_auto():
    body = {"tools": TOOLS, "tool_choice": "required"}
    with pytest.raises(BadRequest) as e:
        tool_request(body, None)
    assert e.value.param == "tool_choice"
    assert tool_request({"tools": TOOLS}, None).output() is None  # rendered, not parsed
    lenient = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "if": {}}}}]
    assert tool_request({"tools": lenient}, HERMES).choice == "auto"
