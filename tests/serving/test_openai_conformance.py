"""OpenAI conformance on SmolLM2, through the official `openai` client against `cann-run serve` on 127.0.0.1:
structured outputs validated by `jsonschema`, `n` choices, log-probabilities against onnxruntime's, and
refusals in OpenAI's error shape as the SDK's own exception types."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import numpy as np
import openai
import pytest
from conftest import ort_reference
from served import Server

from cann_llm.runtime import load_artifact
from cann_llm.runtime.feeds import causal_lm_inputs
from cann_llm.runtime.signature import io_signature, llm_dimensions
from cann_llm.runtime.tokenizer import TextTokenizer

pytestmark = pytest.mark.slow
KEY = "conformance-key"

# twenty schemas of the kinds clients send: nested objects, arrays, enums, required and optional fields,
# numbers with bounds, $defs, a top-level array; strings and arrays bounded so that a 135M model ends them
SCHEMAS = [
    ("person", {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"], "additionalProperties": False}),
    ("city", {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}, "country": {"type": "string", "maxLength": 30}, "population": {"type": "integer", "minimum": 0}}, "required": ["city", "country", "population"], "additionalProperties": False}),
    ("color_enum", {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"], "additionalProperties": False}),
    ("bool_flag", {"type": "object", "properties": {"answer": {"type": "boolean"}, "confidence": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["answer", "confidence"], "additionalProperties": False}),
    ("tags_array", {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3}}, "required": ["tags"], "additionalProperties": False}),
    ("numbers", {"type": "object", "properties": {"values": {"type": "array", "items": {"type": "integer", "minimum": -100, "maximum": 100}, "minItems": 2, "maxItems": 4}}, "required": ["values"], "additionalProperties": False}),
    ("nested_address", {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "address": {"type": "object", "properties": {"street": {"type": "string", "maxLength": 30}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["street", "zip"], "additionalProperties": False}}, "required": ["name", "address"], "additionalProperties": False}),
    ("book", {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40}, "year": {"type": "integer", "minimum": 1450, "maximum": 2030}, "genre": {"enum": ["fiction", "science", "history", "poetry"]}}, "required": ["title", "year", "genre"], "additionalProperties": False}),
    ("rating", {"type": "object", "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5}, "comment": {"type": "string", "maxLength": 40}}, "required": ["stars", "comment"], "additionalProperties": False}),
    ("point", {"type": "object", "properties": {"x": {"type": "number", "minimum": -10, "maximum": 10}, "y": {"type": "number", "minimum": -10, "maximum": 10}}, "required": ["x", "y"], "additionalProperties": False}),
    ("array_of_objects", {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "minItems": 1, "items": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["name", "qty"], "additionalProperties": False}}}, "required": ["items"], "additionalProperties": False}),
    ("optional_field", {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999}, "note": {"type": "string", "maxLength": 20}}, "required": ["id"], "additionalProperties": False}),
    ("nullable", {"type": "object", "properties": {"email": {"anyOf": [{"type": "string", "maxLength": 30}, {"type": "null"}]}}, "required": ["email"], "additionalProperties": False}),
    ("const_version", {"type": "object", "properties": {"version": {"const": "1.0"}, "ok": {"type": "boolean"}}, "required": ["version", "ok"], "additionalProperties": False}),
    ("weekday", {"type": "object", "properties": {"day": {"enum": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]}, "hour": {"type": "integer", "minimum": 0, "maximum": 23}}, "required": ["day", "hour"], "additionalProperties": False}),
    ("deep_nesting", {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {"c": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["c"], "additionalProperties": False}}, "required": ["b"], "additionalProperties": False}}, "required": ["a"], "additionalProperties": False}),
    ("matrix", {"type": "object", "properties": {"rows": {"type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}}, "required": ["rows"], "additionalProperties": False}),
    ("price", {"type": "object", "properties": {"product": {"type": "string", "maxLength": 20}, "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000}, "currency": {"enum": ["USD", "EUR", "CNY"]}}, "required": ["product", "price", "currency"], "additionalProperties": False}),
    ("defs_ref", {"$defs": {"pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "age": {"type": "integer", "minimum": 0, "maximum": 30}}, "required": ["kind", "age"], "additionalProperties": False}}, "type": "object", "properties": {"pets": {"type": "array", "minItems": 1, "maxItems": 2, "items": {"$ref": "#/$defs/pet"}}}, "required": ["pets"], "additionalProperties": False}),
    ("top_level_array", {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "object", "properties": {"word": {"type": "string", "maxLength": 12}}, "required": ["word"], "additionalProperties": False}}),
]


@pytest.fixture(scope="module")
def om(smollm2_path, compiled):
    return compiled(smollm2_path, enable_paged_attention=True)


@pytest.fixture(scope="module")
def client(om):
    server = Server("--model", f"smollm2={om}", "--max_batch_size", "16", "--kv_cache_pages", "256",
                    "--max_context_len", "2048", "--api-key", KEY, "--num_speculative_tokens", "4")
    yield openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=300)
    server.stop()


def _ask_for(client, name: str, schema: dict, temperature: float):
    return client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": f"Give me a {name.replace('_', ' ')} as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}},
        max_tokens=200, temperature=temperature, seed=3)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_twenty_json_schemas_each_parse_and_validate(client, temperature):
    with ThreadPoolExecutor(len(SCHEMAS)) as pool:  # all at once: the engine batches them
        answers = list(pool.map(lambda item: _ask_for(client, *item, temperature), SCHEMAS))
    invalid = {}
    for (name, schema), answer in zip(SCHEMAS, answers):
        choice = answer.choices[0]
        try:
            jsonschema.validate(json.loads(choice.message.content), schema)
            assert choice.finish_reason == "stop"
        except (ValueError, jsonschema.ValidationError, AssertionError) as error:
            invalid[name] = f"{type(error).__name__}: {choice.message.content[:120]!r}"
    assert invalid == {}


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_json_mode_gives_an_object(client, temperature):
    answer = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Describe a cat as a JSON object."}],
        response_format={"type": "json_object"}, max_tokens=300, temperature=temperature, seed=5)
    assert answer.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(answer.choices[0].message.content), dict)


def test_choice_and_regex_constraints(client):
    picked = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Is the sky blue?"}], max_tokens=10,
        temperature=1.0, seed=2, n=4, extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
    assert {c.message.content for c in picked.choices} <= {"yes", "no", "maybe"}
    phone = client.completions.create(model="smollm2", prompt="Call me at", max_tokens=20, temperature=0,
                                      extra_body={"structured_outputs": {"regex": r" [0-9]{3}-[0-9]{4}"}})
    assert phone.choices[0].finish_reason == "stop"
    assert len(phone.choices[0].text) == 9 and phone.choices[0].text[4] == "-"


def test_n_choices_are_seeded(client):
    def ask():
        return client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Say hi"}],
                                              max_tokens=8, temperature=1.0, seed=11, n=3, logprobs=True)
    first, again = ask(), ask()
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.message.content for c in first.choices]
    assert texts == [c.message.content for c in again.choices] and len(set(texts)) > 1
    assert first.usage.completion_tokens == sum(len(c.logprobs.content) for c in first.choices)


def test_logprobs_are_log_softmax_of_the_models_logits(client, om, smollm2_path):
    import onnx

    signature = io_signature(onnx.load(str(smollm2_path), load_external_data=False))
    tokenizer = TextTokenizer(load_artifact(om).om.tokenizer_files())
    prompt = tokenizer.encode("The capital of France is")
    answer = client.completions.create(model="smollm2", prompt=prompt, max_tokens=5, temperature=0, logprobs=3)
    logprobs = answer.choices[0].logprobs
    ids = list(prompt)
    for step in range(5):
        feeds = causal_lm_inputs(signature, llm_dimensions(signature), np.asarray([ids], np.int64))
        row = ort_reference(smollm2_path, feeds)["logits"][0, -1].astype(np.float64)
        expected = row - (row.max() + np.log(np.exp(row - row.max()).sum()))
        token = int(np.argmax(expected))
        top = np.argsort(-expected, kind="stable")[:3]
        assert logprobs.tokens[step] == tokenizer.token_text(token)
        assert logprobs.token_logprobs[step] == pytest.approx(expected[token], abs=1e-4)
        assert list(logprobs.top_logprobs[step]) == [tokenizer.token_text(int(t)) for t in top]
        np.testing.assert_allclose(list(logprobs.top_logprobs[step].values()), expected[top], atol=1e-4)
        ids.append(token)


def test_a_stream_of_two_choices_with_usage_and_logprobs(client):
    chunks = list(client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Say hi"}], max_tokens=6, temperature=0.8, seed=1,
        n=2, stream=True, stream_options={"include_usage": True}, logprobs=True))
    texts, tokens = ["", ""], [0, 0]
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        tokens[choice.index] += len(choice.logprobs.content) if choice.logprobs else 0
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12 == sum(tokens)
    assert all(chunk.usage is None for chunk in chunks[:-1])  # OpenAI's include_usage: null until the last
    plain = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Say hi"}],
                                           max_tokens=6, temperature=0.8, seed=1, n=2)
    assert texts == [c.message.content for c in plain.choices]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_logprobs_stop_with_the_text_a_stop_string_cut(client, stream):
    """The tokens scored are those of the text returned: not the stop string's, cut from the text (nor, while
    streaming, those of text held back in case a stop string begins there)."""
    args = dict(model="smollm2", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, logprobs=0, stop=[" 7"])
    if stream:
        text, tokens = "", []
        for chunk in client.completions.create(**args, stream=True):
            (choice,) = chunk.choices
            text += choice.text
            tokens += choice.logprobs.tokens if choice.logprobs else []
    else:
        (choice,) = client.completions.create(**args).choices
        text, tokens = choice.text, choice.logprobs.tokens
    assert text == " 5, 6," and "".join(tokens) == text


def test_content_parts_and_echo(client):
    parts = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": " hi"}]}],
        max_tokens=6, temperature=0)
    plain = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Say hi"}],
                                           max_tokens=6, temperature=0)
    assert parts.choices[0].message.content == plain.choices[0].message.content
    echoed = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=3,
                                       temperature=0, echo=True)
    alone = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=3, temperature=0)
    assert echoed.choices[0].text == "The capital of France is" + alone.choices[0].text


def test_echo_with_logprobs_scores_the_prompt_as_evaluation_harnesses_ask(client, om, smollm2_path):
    import onnx

    signature = io_signature(onnx.load(str(smollm2_path), load_external_data=False))
    tokenizer = TextTokenizer(load_artifact(om).om.tokenizer_files())
    prompt = tokenizer.encode("The capital of France is Paris")
    scored = client.completions.create(model="smollm2", prompt=prompt, max_tokens=1, temperature=0, echo=True,
                                       logprobs=1).choices[0].logprobs
    rows = ort_reference(smollm2_path, causal_lm_inputs(signature, llm_dimensions(signature),
                                                        np.asarray([prompt], np.int64)))["logits"][0].astype(np.float64)
    expected = rows - (rows.max(-1, keepdims=True) + np.log(np.exp(rows - rows.max(-1, keepdims=True)).sum(-1, keepdims=True)))
    assert scored.tokens[:len(prompt)] == [tokenizer.token_text(t) for t in prompt]
    assert scored.token_logprobs[0] is None and scored.top_logprobs[0] is None
    np.testing.assert_allclose(scored.token_logprobs[1:len(prompt)],
                               [expected[i, prompt[i + 1]] for i in range(len(prompt) - 1)], atol=1e-4)
    streamed = [c.choices[0] for c in client.completions.create(model="smollm2", prompt=prompt, max_tokens=8,
                                                                temperature=0, echo=True, logprobs=1, stream=True)]
    assert streamed[0].logprobs.token_logprobs == scored.token_logprobs[:len(prompt)]
    # text_offset runs on over the whole choice, chunk after chunk: each token starts where the last ended
    tokens = [t for c in streamed if c.logprobs for t in c.logprobs.tokens]
    offsets = [o for c in streamed if c.logprobs for o in c.logprobs.text_offset]
    assert len(tokens) == len(prompt) + 8 and offsets == [sum(map(len, tokens[:i])) for i in range(len(tokens))]


def test_echoed_text_offsets_index_the_text_when_the_prompt_has_a_special_token(client, om):
    """A special token is echoed among the tokens but not in the text (decoding drops it): it takes no
    characters, and every other token's offset points at its own text."""
    tokenizer = TextTokenizer(load_artifact(om).om.tokenizer_files())
    special = tokenizer._tokenizer.token_to_id("<|im_start|>")
    prompt = [special, *tokenizer.encode("The capital of France is", add_special_tokens=False)]
    choice = client.completions.create(model="smollm2", prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                       logprobs=0).choices[0]
    assert not choice.text.startswith("<|im_start|>")
    tokens, offsets = choice.logprobs.tokens, choice.logprobs.text_offset
    assert tokens[0] == "<|im_start|>" and offsets[:2] == [0, 0]
    assert all(choice.text[offset:offset + len(token)] == token for token, offset in zip(tokens[1:], offsets[1:]))


def test_chat_logprobs_carry_each_tokens_bytes(client):
    """Characters split across tokens (byte-level pieces show as U+FFFD alone): the bytes add up to the text."""
    answer = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Say it"}], max_tokens=12, temperature=0,
        logprobs=True, top_logprobs=2, extra_body={"structured_outputs": {"choice": ["日本語 🙂"]}}).choices[0]
    assert answer.message.content == "日本語 🙂"
    assert any(t.token.endswith("\ufffd") for t in answer.logprobs.content)
    assert b"".join(bytes(t.bytes) for t in answer.logprobs.content) == "日本語 🙂".encode("utf-8")
    assert answer.logprobs.refusal is None


@pytest.mark.parametrize("request_args,error,param", [
    ({"extra_body": {"logit_bias_v2": {}}}, openai.BadRequestError, "logit_bias_v2"),
    ({"extra_body": {"top_logprobs": 2}}, openai.BadRequestError, "top_logprobs"),
    ({"logit_bias": {"five": 1.0}}, openai.BadRequestError, "logit_bias.five"),
    ({"logit_bias": {"5": 101.0}}, openai.BadRequestError, "logit_bias"),
    ({"logit_bias": {"999999999": 1.0}}, openai.BadRequestError, "logit_bias"),
    ({"temperature": -1}, openai.BadRequestError, "temperature"),
    ({"n": 17}, openai.BadRequestError, "n"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     openai.BadRequestError, "messages.0.content"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     openai.BadRequestError, "response_format"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"structured_outputs": {"regex": "a"}}},
     openai.BadRequestError, "structured_outputs"),
    ({"model": "absent"}, openai.NotFoundError, "model"),
    ({"max_tokens": 2048}, openai.BadRequestError, "max_tokens"),  # the prompt and 2,048 more past the context
    ({"tool_choice": "auto"}, openai.BadRequestError, "tool_choice"),
])
def test_refusals_reach_the_sdk_as_its_own_errors(client, request_args, error, param):
    args = {"model": "smollm2", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **request_args}
    with pytest.raises(error) as raised:
        client.chat.completions.create(**args)
    body = raised.value.body
    assert set(body) == {"message", "type", "param", "code"} and body["param"] == param
    assert body["code"] == raised.value.status_code


def test_the_sdk_retrieves_a_model_by_its_name(client):
    assert client.models.retrieve("smollm2").id == "smollm2"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("absent")


def test_a_wrong_key_is_the_sdks_authentication_error(client):
    stranger = openai.OpenAI(base_url=str(client.base_url), api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as raised:
        stranger.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "x"}])
    assert raised.value.body["type"] == "authentication_error"


def test_tokenize_and_detokenize(client, om):
    import httpx

    url, headers = str(client.base_url).removesuffix("/v1/"), {"Authorization": f"Bearer {KEY}"}
    tokenizer = TextTokenizer(load_artifact(om).om.tokenizer_files())
    said = httpx.post(f"{url}/tokenize", json={"model": "smollm2", "prompt": "Hello there"}, headers=headers).json()
    assert said == {"count": len(tokenizer.encode("Hello there")), "max_model_len": 2048,
                    "tokens": tokenizer.encode("Hello there")}
    back = httpx.post(f"{url}/detokenize", json={"model": "smollm2", "tokens": said["tokens"]}, headers=headers)
    assert back.json() == {"prompt": "Hello there"}
    bad = httpx.post(f"{url}/detokenize", json={"model": "smollm2", "tokens": [10 ** 9]}, headers=headers)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Current time in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                                                          "required": ["city"], "additionalProperties": False}}}]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_tool_call_round_trip_streamed_and_not(client, tool_choice):
    asked = [{"role": "user", "content": "What is the weather in Paris?"}]
    called = client.chat.completions.create(model="smollm2", messages=asked, tools=TOOLS, tool_choice=tool_choice,
                                            max_tokens=100, temperature=0)
    (call,) = called.choices[0].message.tool_calls
    assert called.choices[0].finish_reason == ("tool_calls" if tool_choice == "required" else "stop")
    if call.function.name == "get_weather":
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    streamed = [c.choices[0].delta.tool_calls for c in client.chat.completions.create(
        model="smollm2", messages=asked, tools=TOOLS, tool_choice=tool_choice, max_tokens=100, temperature=0,
        stream=True) if c.choices and c.choices[0].delta.tool_calls]
    assert [(d.index, d.function.name, d.function.arguments) for d in streamed[0]] == [
        (0, call.function.name, call.function.arguments)]
    answered = asked + [called.choices[0].message.model_dump(exclude_none=True),
                        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"celsius": 18})}]
    answer = client.chat.completions.create(model="smollm2", messages=answered, tools=TOOLS, tool_choice="none",
                                            max_tokens=30, temperature=0)
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].message.content.strip()


def test_logit_bias_and_usage_on_every_chunk(client, om):
    tokenizer = TextTokenizer(load_artifact(om).om.tokenizer_files())
    (forced,) = tokenizer.encode(" banana", add_special_tokens=False)
    biased = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=3,
                                       temperature=0, logit_bias={str(forced): 100})
    assert biased.choices[0].text == " banana" * 3
    chunks = list(client.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=5, temperature=0,
                                            stream=True, stream_options={"include_usage": True,
                                                                         "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 5 and all(c.usage.prompt_tokens for c in chunks)
