"""A gRPC `Generate` request's conversation and tools as the chat template and the tool formats take them."""

from __future__ import annotations

import json
from typing import Any

from mtpserve.cluster.engine.errors import InvalidRequestError
from mtpserve.cluster.service.openai_schema import CalledFunction, ToolCallMessage
from mtpserve.cluster.service.tool_calls import ToolCall
from mtpserve.proto.mtpserve.v1 import inference_pb2 as pb

ROLES = ("system", "user", "assistant", "tool")


def conversation_turns(conv: pb.Conversation) -> list[dict[str, Any]]:
    """The turns for the chat template; InvalidRequestError naming `prompt.messages.turns[i]...`."""
    if not conv.turns:
        raise InvalidRequestError("prompt.messages.turns", "must hold at least one turn")
    turns = []
    for i, t in enumerate(conv.turns):
        if t.role not in ROLES:
            raise InvalidRequestError(f"prompt.messages.turns[{i}].role", f"must be one of {', '.join(ROLES)}")
        turn: dict[str, Any] = {"role": t.role, "content": t.content}
        if t.tool_calls:
            calls = [
                ToolCallMessage(id=c.id, function=CalledFunction(name=c.name, arguments=c.arguments))
                for c in t.tool_calls
            ]
            turn["tool_calls"] = [c.for_template() for c in calls]
        if t.tool_call_id:
            turn["tool_call_id"] = t.tool_call_id
        turns.append(turn)
    return turns


def offered_functions(tools: Any, tool_choice: str) -> tuple[list[dict[str, Any]], bool]:
    """(function definitions the reply may call, whether it must call one) under `tool_choice`."""
    defs = []
    for i, tool in enumerate(tools):
        if not tool.name:
            raise InvalidRequestError(f"tools[{i}].name", "must not be empty")
        try:
            params = json.loads(tool.parameters_json) if tool.parameters_json else {"type": "object"}
        except ValueError as exc:
            raise InvalidRequestError(f"tools[{i}].parameters_json", f"is not JSON: {exc}") from None
        defs.append({"name": tool.name, "description": tool.description, "parameters": params})
    choice = tool_choice or "auto"
    if choice == "none" or not defs:
        if choice not in ("auto", "none"):
            raise InvalidRequestError("tool_choice", f"{choice!r} needs tools")
        return [], False
    if choice in ("auto", "required"):
        return defs, choice == "required"
    named = [d for d in defs if d["name"] == choice]
    if not named:
        raise InvalidRequestError("tool_choice", f"names {choice!r}, which is not among tools")
    return named, True


def call_to_proto(call: ToolCall) -> pb.ToolCall:
    """A parsed call as the ToolCall message."""
    return pb.ToolCall(id=call.id, name=call.name, arguments=call.arguments)
