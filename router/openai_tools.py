"""Tool calling on the OpenAI chat API, the request side: `tools`, `tool_choice` and
`parallel_tool_calls` checked and turned into a `ToolRequest`; the chat messages that carry
tool calls and tool results normalized for the chat template; and, when the client forces a
call (`tool_choice: "required"` or a named function), the grammar that makes the model's
output a call in the served model's format (router/tool_calls.py), whose arguments always
match the function's parameters schema.

What is checked here is the request's shape; the grammar is compiled against the model's
vocabulary where every constraint is (router/structured.py, off the event loop).
"""

from __future__ import annotations

import json
import reprlib
from dataclasses import dataclass
from typing import Any

from pagemesh.api.options.constraint import OutputConstraint
from router.openai_errors import ProtocolError
from router.structured import JSON_OPTIONS, lark_literal
from router.tool_calls import HERMES, LLAMA3_JSON, MISTRAL, CallFormat

TOOL_CHOICES = ("none", "auto", "required")
# The key each format writes a call's arguments under.
_ARGUMENTS_KEY = {
    HERMES.name: "arguments",
    LLAMA3_JSON.name: "parameters",
    MISTRAL.name: "arguments",
}
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def _shown(value: Any) -> str:
    """A bad value quoted back in an error message, short whatever the client sent."""
    short = reprlib.Repr()
    short.maxstring = short.maxother = 40
    return short.repr(value)


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools: `tools` as the chat template takes them, and what the model
    may do with them. `choice` is "none", "auto", "required", or the name of the function
    it must call."""

    tools: list[dict[str, Any]]
    choice: str
    parallel: bool = True  # more than one call per reply

    @property
    def parses_calls(self) -> bool:
        """Whether the reply is parsed for calls (not with tool_choice "none")."""
        return self.choice != "none"

    @property
    def forced(self) -> bool:
        return self.choice not in ("none", "auto")

    def function_names(self) -> list[str]:
        return [tool["function"]["name"] for tool in self.tools]


def tool_request(body: dict[str, Any]) -> ToolRequest | None:
    """The body's tools, or None without any. A forced call with another output constraint
    (`response_format`, `guided_*`) is refused: both cannot hold."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise ProtocolError("tool_choice needs `tools` to choose from", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise ProtocolError(
            'tools must be a list of {"type": "function", "function": '
            '{"name", "description", "parameters"}} objects',
            "tools",
        )
    normalized = [_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools)]
    names = [tool["function"]["name"] for tool in normalized]
    if len(set(names)) < len(names):
        raise ProtocolError(f"tools name a function twice: {names}", "tools")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ProtocolError(
            f"parallel_tool_calls must be true or false, got {_shown(parallel)}",
            "parallel_tool_calls",
        )
    request = ToolRequest(normalized, _choice(choice, names), parallel is not False)
    if request.forced:
        for field in (
            "response_format",
            "guided_json",
            "guided_regex",
            "guided_choice",
            "guided_grammar",
            "structured_outputs",
        ):
            value = body.get(field)
            if value is not None and value != {"type": "text"}:
                raise ProtocolError(
                    f"tool_choice {_shown(choice)} constrains the output to a "
                    f"tool call; it cannot be combined with {field}",
                    field,
                )
    return request


def _tool(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise ProtocolError(f'{where} must be {{"type": "function", "function": {{...}}}}', where)
    function = tool.get("function")
    if not isinstance(function, dict):
        raise ProtocolError(f"{where}.function must be an object with a name", f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not name or len(name) > 64:
        raise ProtocolError(
            f"{where}.function.name must be a string of 1 to 64 characters, got {_shown(name)}",
            f"{where}.function.name",
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ProtocolError(
            f"{where}.function.description must be a string", f"{where}.function.description"
        )
    parameters = function.get("parameters")
    if parameters is None:
        parameters = dict(_EMPTY_PARAMETERS)
    elif not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise ProtocolError(
            f'{where}.function.parameters must be a JSON schema of an object ("type": "object")',
            f"{where}.function.parameters",
        )
    return {"type": "function", "function": {**function, "parameters": parameters}}


def _choice(choice: Any, names: list[str]) -> str:
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise ProtocolError(
                f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or "
                f'{{"type": "function", "function": {{"name": ...}}}}, '
                f"got {_shown(choice)}",
                "tool_choice",
            )
        return choice
    if not isinstance(choice, dict) or choice.get("type") != "function":
        raise ProtocolError(
            'tool_choice must be a string or {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ProtocolError("tool_choice.function.name must be a string", "tool_choice")
    if name not in names:
        raise ProtocolError(
            f"tool_choice names function {name!r}, which is not in tools ({', '.join(names)})",
            "tool_choice",
        )
    return name


# ---------------------------------------------------------------- messages


def tool_calls_for_template(value: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls` as Hugging Face chat templates take them: each
    call's arguments a dict, not the JSON text OpenAI sends."""
    if not isinstance(value, list):
        raise ProtocolError(f"{where}.tool_calls must be a list of calls", f"{where}.tool_calls")
    calls = []
    for index, call in enumerate(value):
        at = f"{where}.tool_calls[{index}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ProtocolError(
                f'{at} must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}',
                at,
            )
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                raise ProtocolError(
                    f"{at}.function.arguments is not valid JSON", f"{at}.function.arguments"
                ) from None
        if not isinstance(arguments, dict):
            raise ProtocolError(
                f"{at}.function.arguments must be a JSON object", f"{at}.function.arguments"
            )
        call_id = call.get("id")
        calls.append(
            {
                "id": call_id if isinstance(call_id, str) else f"call_{index}",
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return calls


# ---------------------------------------------------------------- forced calls


def forced_call_constraint(request: ToolRequest, fmt: CallFormat) -> OutputConstraint | None:
    """The grammar that makes the reply tool calls in `fmt` (None unless the request forces
    a call): the named function's, or one or more of any tool's (one only when
    `parallel_tool_calls` is false)."""
    if not request.forced:
        return None
    names = request.function_names() if request.choice == "required" else [request.choice]
    functions = {tool["function"]["name"]: tool["function"] for tool in request.tools}
    rules = []
    for index, name in enumerate(names):
        where = f"tools[{request.function_names().index(name)}].function.parameters"
        rules.append(
            f"fn_{index}: %json "
            + _call_schema(name, functions[name]["parameters"], _ARGUMENTS_KEY[fmt.name], where)
        )
    several = request.choice == "required" and request.parallel
    lines = [
        _start_rule(fmt, several),
        "call: " + " | ".join(f"fn_{i}" for i in range(len(names))),
        *rules,
    ]
    return OutputConstraint("grammar", "\n".join(lines))


def _start_rule(fmt: CallFormat, several: bool) -> str:
    if fmt is HERMES:
        block = (
            f"{lark_literal('<tool_call>' + chr(10))} call {lark_literal(chr(10) + '</tool_call>')}"
        )
        return f"start: {block}" + (f" ({lark_literal(chr(10))} {block})*" if several else "")
    if fmt is LLAMA3_JSON:
        return "start: call" + (f" ({lark_literal('; ')} call)*" if several else "")
    return (
        f"start: {lark_literal('[TOOL_CALLS][')} call"
        + (f" ({lark_literal(', ')} call)*" if several else "")
        + f" {lark_literal(']')}"
    )


def _call_schema(name: str, parameters: dict[str, Any], arguments_key: str, where: str) -> str:
    """One call's JSON schema, as JSON text (llguidance's `%json` takes it), written as
    every constraint is written (router/structured.py JSON_OPTIONS)."""
    from llguidance import LLMatcher

    try:
        error = LLMatcher.validate_grammar(
            LLMatcher.grammar_from_json_schema(parameters, defaults=JSON_OPTIONS)
        )
    except ValueError as exc:
        error = str(exc)
    if error:
        raise ProtocolError(
            f"{where} is not a JSON schema a call can be constrained to: {error}", where
        )
    schema = {
        "type": "object",
        "properties": {"name": {"const": name}, arguments_key: parameters},
        "required": ["name", arguments_key],
        "additionalProperties": False,
        "x-guidance": JSON_OPTIONS,
    }
    return json.dumps(schema)
