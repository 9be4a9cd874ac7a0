"""What a simulated answer says when the client asked for more than free text: tool calls whose
arguments validate against the function's schema, JSON for `response_format`, `stop` strings,
`seed`, `n` choices, and per-token logprobs.

`read_spec` reads those fields once from the chat body (`OutputSpec.plain` is the common case,
which keeps the engine's planned vocabulary text and the pre-encoded stream path untouched);
`plan_choice` rewrites one engine request's planned output before it is submitted. The output is
still decided at admission, deterministic per (prompt, engine seed, request seed, choice index):
same seed, same text; a different seed or choice, another draw.

Tool calls come where vLLM's tool-call parsing would find one: always under `tool_choice:
required` or a named function; under `auto`, on about half of the turns that follow a user
message (never right after a tool result, where a model answers in words). The arguments are
real tokenizer ids of the JSON text, so lengths, usage and streamed deltas are what a real model
would produce; a budget shorter than the JSON cuts it (`finish_reason: length`), as on vLLM.

JSON from a schema
------------------
`generate`: JSON values that satisfy a JSON Schema: what the simulated model emits for tool-call arguments,
`response_format: json_schema` and `json_object` (vLLM constrains decoding with a grammar; the
simulator draws a conforming value directly).

Covers the keywords clients' schemas use (pydantic's and OpenAI's strict mode included): `type`
(one or a list), `enum`, `const`, `properties` / `required` / `additionalProperties`, `items` /
`prefixItems` / `minItems` / `maxItems`, `minLength` / `maxLength`, `minimum` / `maximum` /
`exclusiveMinimum` / `exclusiveMaximum` / `multipleOf`, `anyOf` / `oneOf` (one branch), `allOf`
(merged), `$ref` into `$defs` / `definitions`, common string `format`s. Optional properties are
included about half the time; strings are words of the simulator's vocabulary; recursion is cut
at a fixed depth (the optional parts first). A schema that recurses without end (a required property
or an `anyOf` branch that `$ref`s back to itself) is cut too: past `CUT_DEPTH` levels a value is the
smallest of its type (`{}`, `[]`, `""`, 0, false, null), and so is every value past the first
`MAX_VALUES` of one document (a recursion that branches), so generation always ends, bounded.
"""

from __future__ import annotations

import codecs
import os
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import xxhash

from backends.tokenization import encode, encoding
from sim import text_gen
from sim.scheduler import Request

MAX_CHOICES = 16
MAX_TOP_LOGPROBS = 20
AUTO_TOOL_SHARE = 0.5


class SpecError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message, self.param = message, param


@dataclass(frozen=True, slots=True)
class OutputSpec:
    tools: tuple[Mapping[str, Any], ...] = ()  # chat tools' `function` objects
    tool_choice: Any = None
    json_schema: Mapping[str, Any] | None = None
    json_object: bool = False
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    after_tool_result: bool = False  # the last message is a tool result

    @property
    def plain(self) -> bool:
        """Nothing asked beyond free text: the engine's own plan and the fast stream path."""
        return (
            self.n == 1
            and self.seed is None
            and not self.stop
            and not self.logprobs
            and self.json_schema is None
            and not self.json_object
            and (not self.tools or self.tool_choice == "none")
        )


_PLAIN = OutputSpec()


def _int(body: Mapping[str, Any], name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise SpecError(f"'{name}' must be an integer from {low} to {high}", name)
    return value


def read_spec(body: Mapping[str, Any], chat: bool = True) -> OutputSpec:
    """The output options of a chat (or completions) body; SpecError names a bad field."""
    keys = ("tools", "response_format", "stop", "seed", "logprobs", "n")
    if not any(body.get(k) is not None for k in keys):
        return _PLAIN
    n = _int(body, "n", 1, MAX_CHOICES) or 1
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise SpecError("'seed' must be an integer", "seed")
    stop_value = body.get("stop")
    if stop_value is None:
        stop: tuple[str, ...] = ()
    elif isinstance(stop_value, str):
        stop = (stop_value,) if stop_value else ()
    elif isinstance(stop_value, list) and all(isinstance(s, str) for s in stop_value):
        stop = tuple(s for s in stop_value if s)
    else:
        raise SpecError("'stop' must be a string or an array of strings", "stop")
    if chat:
        logprobs = body.get("logprobs")
        if logprobs is not None and not isinstance(logprobs, bool):
            raise SpecError("'logprobs' must be a boolean", "logprobs")
        top = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
        if top and not logprobs:
            raise SpecError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        want_logprobs = bool(logprobs)
    else:  # completions: `logprobs` is the number of alternatives
        top = _int(body, "logprobs", 0, MAX_TOP_LOGPROBS) or 0
        want_logprobs = body.get("logprobs") is not None
    tools, choice = _tools(body) if chat else ((), None)
    schema, json_object = _format(body) if chat else (None, False)
    messages = body.get("messages") if chat else None
    last_role = (
        messages[-1].get("role")
        if isinstance(messages, list) and messages and isinstance(messages[-1], Mapping)
        else None
    )
    return OutputSpec(tools, choice, schema, json_object, stop, seed, want_logprobs, top, n, last_role == "tool")


def _tools(body: Mapping[str, Any]) -> tuple[tuple[Mapping[str, Any], ...], Any]:
    tools = body.get("tools")
    if tools is None:
        return (), None
    if not isinstance(tools, list):
        raise SpecError("'tools' must be an array", "tools")
    functions: list[Mapping[str, Any]] = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise SpecError(f"tools[{i}] must be a function with a name", f"tools[{i}]")
        functions.append(function)
    choice = body.get("tool_choice", "auto" if functions else None)
    if isinstance(choice, Mapping):
        name = (choice.get("function") or {}).get("name") if isinstance(choice.get("function"), Mapping) else None
        if not any(f["name"] == name for f in functions):
            raise SpecError(f"tool_choice names the function {name!r}, which is not in 'tools'", "tool_choice")
    elif choice not in ("auto", "none", "required", None):
        raise SpecError("'tool_choice' must be 'auto', 'none', 'required' or a named function", "tool_choice")
    if choice == "required" and not functions:
        raise SpecError("tool_choice 'required' needs at least one tool", "tool_choice")
    return tuple(functions), choice


def _format(body: Mapping[str, Any]) -> tuple[Mapping[str, Any] | None, bool]:
    fmt = body.get("response_format")
    if fmt is None:
        return None, False
    kind = fmt.get("type") if isinstance(fmt, Mapping) else None
    if kind == "text":
        return None, False
    if kind == "json_object":
        return None, True
    if kind == "json_schema":
        assert isinstance(fmt, Mapping)
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, Mapping) else None
        if not isinstance(schema, Mapping):
            raise SpecError("response_format.json_schema.schema must be an object", "response_format")
        return schema, False
    raise SpecError("response_format.type must be 'text', 'json_object' or 'json_schema'", "response_format")


@dataclass(slots=True)
class Choice:
    """One choice's planned output: the engine request and how its tokens read."""

    index: int
    req: Request
    pieces: list[str] | None = None  # text of each output token; None: the vocabulary's (text_gen)
    tool_name: str | None = None
    tool_call_id: str | None = None
    stop_string: str | None = None  # the stop string that ended it
    seed: int = 0

    def text(self, start: int, end: int) -> str:
        if self.pieces is not None:
            return "".join(self.pieces[start:end])
        return text_gen.render(self.req.output_ids[start:end])

    @property
    def finish_reason(self) -> str | None:
        reason = self.req.finish_reason
        if reason == "stop" and self.tool_name is not None:
            return "tool_calls"
        return reason


def _mix(value: int) -> int:
    return xxhash.xxh3_64_intdigest(value.to_bytes(16, "little", signed=True))


def _pieces(ids: Sequence[int]) -> list[str]:
    """Each token's text, decoded incrementally (a token ending inside a UTF-8 character adds "")."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    single = encoding().decode_single_token_bytes
    return [decoder.decode(single(i)) for i in ids]


def _set_structured(choice: Choice, text: str) -> None:
    req = choice.req
    ids = encode(text)
    budget = max(req.max_tokens, 1)
    req.output_ids = ids[:budget]
    req.stop_reason_at_end = "stop" if len(ids) <= budget else "length"
    choice.pieces = _pieces(req.output_ids)


def _apply_stop(choice: Choice, stops: Sequence[str]) -> None:
    req = choice.req
    texts = (
        choice.pieces if choice.pieces is not None else [text_gen.vocabulary().text_by_id[i] for i in req.output_ids]
    )
    full = "".join(texts)
    best: tuple[int, str] | None = None
    for stop in stops:
        at = full.find(stop)
        if at >= 0 and (best is None or at < best[0]):
            best = (at, stop)
    if best is None:
        return
    at, stop = best
    start = j = 0
    while j < len(texts) and start + len(texts[j]) <= at:  # the token in which the stop begins ends it
        start += len(texts[j])
        j += 1
    req.output_ids = req.output_ids[: j + 1]
    req.stop_reason_at_end = "stop"
    choice.pieces = [*texts[:j], texts[j][: at - start]]
    choice.stop_string = stop


def _pick_tool(spec: OutputSpec, rng_value: float, draw: int) -> Mapping[str, Any] | None:
    if not spec.tools or spec.tool_choice == "none":
        return None
    choice = spec.tool_choice
    if isinstance(choice, Mapping):
        name = choice["function"]["name"]
        return next(f for f in spec.tools if f["name"] == name)
    if choice == "auto" and (spec.after_tool_result or rng_value >= AUTO_TOOL_SHARE):
        return None
    return spec.tools[draw % len(spec.tools)]


def plan_choice(
    req: Request, spec: OutputSpec, engine_seed: int, index: int, *, output_len_mean: float, ignore_eos: bool
) -> Choice:
    """Rewrite `req`'s planned output for this choice (before the request is submitted)."""
    if spec.plain:
        return Choice(index, req)
    seed = engine_seed
    if spec.seed is not None:
        seed ^= _mix(spec.seed)
    if index:
        seed ^= _mix(0x5EED0000 + index)
    rng = text_gen.request_rng(req.prompt_ids, seed)
    choice = Choice(index, req, seed=seed)
    function = _pick_tool(spec, rng.random(), rng.getrandbits(16))
    if function is not None:
        parameters = function.get("parameters")
        arguments = generate(parameters if isinstance(parameters, Mapping) else {"type": "object"}, rng)
        _set_structured(choice, orjson.dumps(arguments).decode())
        choice.tool_name = str(function["name"])
        choice.tool_call_id = f"chatcmpl-tool-{os.urandom(16).hex()}"
        return choice
    if spec.json_schema is not None or spec.json_object:
        value = generate(spec.json_schema, rng) if spec.json_schema is not None else free_object(rng)
        _set_structured(choice, orjson.dumps(value).decode())
        return choice
    if spec.seed is not None or index:  # another draw of the free text
        budget = req.max_tokens
        natural = budget if ignore_eos else text_gen.natural_length(rng, output_len_mean)
        length = min(natural, budget)
        req.output_ids = text_gen.generate_ids(rng, max(1, length))
        req.stop_reason_at_end = "stop" if natural < budget else "length"
    if spec.stop:
        _apply_stop(choice, spec.stop)
    return choice


# --- logprobs ------------------------------------------------------------------------------------


def _token_entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def chat_logprobs(choice: Choice, start: int, end: int, top: int) -> list[dict[str, Any]]:
    """`logprobs.content` entries of tokens [start, end): the chosen token and `top` alternatives,
    in decreasing probability (deterministic per choice and position)."""
    words = text_gen.vocabulary().text_by_id
    alternatives = list(words.values())
    out: list[dict[str, Any]] = []
    for position in range(start, end):
        h = xxhash.xxh3_64_intdigest(position.to_bytes(8, "little"), seed=choice.seed & (2**64 - 1))
        logprob = -(((h & 0xFFFF) / 0xFFFF) ** 2) * 2.0
        text = choice.text(position, position + 1)
        entry = _token_entry(text, round(logprob, 6))
        tops = [_token_entry(text, entry["logprob"])]
        for k in range(1, top):
            alt = alternatives[(h >> (16 + 4 * k)) % len(alternatives)]
            tops.append(_token_entry(alt, round(logprob - 0.7 * k - ((h >> k) & 7) / 10, 6)))
        entry["top_logprobs"] = tops[:top]
        out.append(entry)
    return out


def completion_logprobs(choice: Choice, start: int, end: int, top: int, offset: int) -> dict[str, Any]:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs, text_offset."""
    entries = chat_logprobs(choice, start, end, max(top, 1))
    offsets = []
    position = offset
    for entry in entries:
        offsets.append(position)
        position += len(entry["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"][:top]} for e in entries] if top else None,
        "text_offset": offsets,
    }


# --- JSON from a schema ---------------------------------------------------------------------------

_WORDS = (
    "alpha", "river", "stone", "light", "cloud", "green", "north", "paper", "table", "music",
    "water", "field", "quick", "silver", "market", "garden", "window", "letter", "story", "power",
)  # fmt: skip
_FORMATS = {
    "date-time": "2024-05-17T09:30:00Z",
    "date": "2024-05-17",
    "time": "09:30:00",
    "email": "user@example.com",
    "uri": "https://example.com/item",
    "url": "https://example.com/item",
    "uuid": "123e4567-e89b-42d3-a456-426614174000",
    "ipv4": "192.0.2.1",
    "hostname": "example.com",
}
MAX_DEPTH = 6
CUT_DEPTH = 4 * MAX_DEPTH  # required parts recurse past MAX_DEPTH; nothing recurses past this
MAX_VALUES = 20_000  # values one generated document may hold (a schema can branch exponentially)
_SMALLEST: dict[str, Any] = {"object": {}, "array": [], "string": "", "integer": 0, "number": 0, "boolean": False}


def _resolve(schema: Mapping[str, Any], root: Mapping[str, Any]) -> Mapping[str, Any]:
    seen = 0
    while isinstance(schema.get("$ref"), str) and seen < 16:
        ref = str(schema["$ref"])
        target: Any = root
        if not ref.startswith("#"):
            return {}
        for key in filter(None, ref[1:].split("/")):
            target = target.get(key.replace("~1", "/").replace("~0", "~")) if isinstance(target, Mapping) else None
        if not isinstance(target, Mapping):
            return {}
        rest = {k: v for k, v in schema.items() if k != "$ref"}
        schema = {**target, **rest}
        seen += 1
    return schema


def _merge_all_of(schema: Mapping[str, Any], root: Mapping[str, Any]) -> Mapping[str, Any]:
    parts = schema.get("allOf")
    if not isinstance(parts, list):
        return schema
    merged: dict[str, Any] = {k: v for k, v in schema.items() if k != "allOf"}
    for part in parts:
        if not isinstance(part, Mapping):
            continue
        part = _resolve(part, root)
        for key, value in part.items():
            if key == "properties" and isinstance(value, Mapping):
                merged["properties"] = {**merged.get("properties", {}), **value}
            elif key == "required" and isinstance(value, list):
                merged["required"] = [*merged.get("required", []), *value]
            else:
                merged.setdefault(key, value)
    return merged


def _words(rng: random.Random, count: int) -> str:
    return " ".join(_WORDS[rng.randrange(len(_WORDS))] for _ in range(max(count, 1)))


def _string(schema: Mapping[str, Any], rng: random.Random) -> str:
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt in _FORMATS:
        return _FORMATS[fmt]
    low = int(schema.get("minLength") or 0)
    high = schema.get("maxLength")
    text = _words(rng, rng.randint(1, 4))
    while len(text) < low:
        text += " " + _words(rng, 2)
    if isinstance(high, int):
        text = text[:high]
    return text


def _number(schema: Mapping[str, Any], rng: random.Random, integer: bool) -> int | float:
    low, high = schema.get("minimum"), schema.get("maximum")
    ex_low, ex_high = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
    lo = float(low) if isinstance(low, int | float) else (float(ex_low) + 1 if isinstance(ex_low, int | float) else 0.0)
    hi = (
        float(high)
        if isinstance(high, int | float)
        else (float(ex_high) - 1 if isinstance(ex_high, int | float) else lo + 100)
    )
    hi = max(hi, lo)
    step = schema.get("multipleOf")
    if isinstance(step, int | float) and step > 0:
        first = -(-lo // step) * step
        count = int((hi - first) // step)
        value = first + step * rng.randint(0, max(count, 0))
        return int(value) if integer else value
    if integer:
        return rng.randint(int(-(-lo // 1)), max(int(hi // 1), int(-(-lo // 1))))
    return round(rng.uniform(lo, hi), 2)


def _object(
    schema: Mapping[str, Any], rng: random.Random, root: Mapping[str, Any], depth: int, left: list[int]
) -> dict[str, Any]:
    properties = schema.get("properties")
    properties = properties if isinstance(properties, Mapping) else {}
    required = set(schema.get("required") or ())
    out: dict[str, Any] = {}
    for name, sub in properties.items():
        if name in required or (depth < MAX_DEPTH - 2 and rng.random() < 0.5):
            out[name] = generate(sub if isinstance(sub, Mapping) else {}, rng, root, depth + 1, _left=left)
    if not properties and schema.get("additionalProperties") not in (False, None) and depth < MAX_DEPTH:
        extra = schema.get("additionalProperties")
        sub_schema = extra if isinstance(extra, Mapping) else {"type": "string"}
        for _ in range(rng.randint(1, 3)):
            out[_WORDS[rng.randrange(len(_WORDS))]] = generate(sub_schema, rng, root, depth + 1, _left=left)
    return out


def _array(
    schema: Mapping[str, Any], rng: random.Random, root: Mapping[str, Any], depth: int, left: list[int]
) -> list[Any]:
    prefix = schema.get("prefixItems")
    items = schema.get("items")
    low = int(schema.get("minItems") or 0)
    high = schema.get("maxItems")
    count = max(low, rng.randint(1, 3) if depth < MAX_DEPTH else 0)
    if isinstance(high, int):
        count = min(count, high)
    out: list[Any] = []
    if isinstance(prefix, list):
        out = [generate(p if isinstance(p, Mapping) else {}, rng, root, depth + 1, _left=left) for p in prefix]
        if items is False:
            return out
    item_schema = items if isinstance(items, Mapping) else {"type": "string"}
    while len(out) < count and left[0] > 0:  # a huge minItems ends with the document's budget
        out.append(generate(item_schema, rng, root, depth + 1, _left=left))
    return out


def generate(
    schema: Mapping[str, Any],
    rng: random.Random,
    root: Mapping[str, Any] | None = None,
    depth: int = 0,
    *,
    _left: list[int] | None = None,
) -> Any:
    """A value valid against `schema` (a subset of JSON Schema; unknown keywords are ignored).
    `_left` counts the values one call may still make (MAX_VALUES), shared by its recursion."""
    root = schema if root is None else root
    left = [MAX_VALUES] if _left is None else _left
    schema = _merge_all_of(_resolve(schema, root), root)
    left[0] -= 1
    if depth > CUT_DEPTH or left[0] < 0:
        return _smallest(schema)
    if "const" in schema:
        return schema["const"]
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return enum[rng.randrange(len(enum))]
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if isinstance(branches, list) and branches:
            usable = [b for b in branches if isinstance(b, Mapping)]
            if depth >= MAX_DEPTH:  # prefer a branch that ends the recursion
                usable = [b for b in usable if b.get("type") == "null"] or usable
            if usable:
                base = {k: v for k, v in schema.items() if k != key}
                branch = usable[rng.randrange(len(usable))]
                # a branch that refers elsewhere may refer back here: it counts as a level
                return generate({**base, **branch}, rng, root, depth + 1 if "$ref" in branch else depth, _left=left)
    kind = schema.get("type")
    if isinstance(kind, list):
        kinds = [k for k in kind if isinstance(k, str)]
        if depth >= MAX_DEPTH and "null" in kinds:
            kind = "null"
        else:
            kind = next((k for k in kinds if k != "null"), "null") if kinds else None
    if kind is None:
        if "properties" in schema:
            kind = "object"
        elif "items" in schema:
            kind = "array"
        else:
            kind = "object" if depth == 0 else "string"
    if kind == "object":
        return _object(schema, rng, root, depth, left)
    if kind == "array":
        return _array(schema, rng, root, depth, left)
    if kind == "string":
        return _string(schema, rng)
    if kind == "integer":
        return _number(schema, rng, integer=True)
    if kind == "number":
        return _number(schema, rng, integer=False)
    if kind == "boolean":
        return rng.random() < 0.5
    return None


def _smallest(schema: Mapping[str, Any]) -> Any:
    """The smallest value of the schema's (first) type: where a recursion is cut."""
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = "null" if "null" in kind else next((k for k in kind if isinstance(k, str)), None)
    if kind is None:
        kind = "object" if "properties" in schema else ("array" if "items" in schema else None)
    value = _SMALLEST.get(kind) if isinstance(kind, str) else None
    return type(value)() if isinstance(value, dict | list) else value


def free_object(rng: random.Random) -> dict[str, Any]:
    """What `json_object` mode says when no schema was given: a small flat object."""
    keys = rng.sample(_WORDS, rng.randint(2, 4))
    return {key: (_words(rng, rng.randint(1, 3)) if rng.random() < 0.7 else rng.randint(0, 99)) for key in keys}
