"""Model responses as journaled LLM calls.

:class:`DurableModel` wraps any SDK :class:`~agents.models.interface.Model`: its
``get_response`` becomes ``ctx.llm``, whose recorded content is the whole
:class:`~agents.items.ModelResponse` in its JSON form (output items, usage, response id)
with the token usage counted against the task's budget. A re-run gets the response back
from the log without calling the model, and the SDK continues from it exactly as it did.

The request recorded with each call is a digest, not the conversation: the SDK sends the
whole history every turn, and storing it again on every call would grow the log with the
square of the turns. The digest covers the instructions, the input items, and the tools and
handoffs offered, so a re-run that would send the model something else is caught as a
divergence (``NonDeterminismError``) instead of being answered with a stale response.

Streaming is recorded whole: ``stream_response`` journals the list of stream events and
replays it, so a streamed run resumes too (events are delivered once the response is in).
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from typing import Any, Final

import orjson
import pydantic
import pydantic_core
from agents.agent_output import AgentOutputSchemaBase
from agents.handoffs import Handoff
from agents.items import ModelResponse, TResponseInputItem, TResponseStreamEvent
from agents.model_settings import ModelSettings
from agents.models.interface import Model, ModelProvider, ModelTracing
from agents.tool import Tool
from openai.types.responses.response_prompt_param import ResponsePromptParam

from wal_engine.runtime.context import AgentContext, LlmResponse

_responses: Final = pydantic.TypeAdapter(ModelResponse)
_stream_events: Final = pydantic.TypeAdapter(list[TResponseStreamEvent])


def plain(value: Any) -> Any:
    """``value`` (SDK items, pydantic models, dataclasses, TypedDicts) as plain JSON."""
    return pydantic_core.to_jsonable_python(value, serialize_unknown=True)


def digest(value: Any) -> str:
    """sha256 hex of ``value``'s plain JSON with sorted keys (stable across processes)."""
    encoded = orjson.dumps(plain(value), option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(encoded).hexdigest()


def model_label(model: Model, fallback: str | None = None) -> str:
    """The name a model's calls are journaled under: its model name when it has one."""
    name = getattr(model, "model", None)
    if isinstance(name, str) and name:
        return name
    return fallback or type(model).__name__


class DurableModel(Model):
    """An SDK model whose responses are journaled wal-engine LLM calls."""

    def __init__(self, ctx: AgentContext, model: Model, *, name: str | None = None,
                 checkpoint_each_turn: bool = True) -> None:
        """Wrap ``model`` for the task of ``ctx``.

        Args:
            ctx: The wal-engine agent context of the running task.
            model: The model that answers when the log has no response yet.
            name: The journal name of its calls (default: the model's name).
            checkpoint_each_turn: Record a step boundary before each model call, so that
                the task's step budget counts turns and a worker that shuts down hands the
                task back between turns.
        """
        self.ctx = ctx
        self.model = model
        self.name = name or model_label(model)
        self.checkpoint_each_turn = checkpoint_each_turn

    async def close(self) -> None:
        """Close the wrapped model."""
        await self.model.close()

    async def _cleanup_on_run_end(self, owner: object) -> None:
        await self.model._cleanup_on_run_end(owner)

    def request(self, system_instructions: str | None, input: str | list[TResponseInputItem],
                tools: list[Tool], output_schema: AgentOutputSchemaBase | None,
                handoffs: list[Handoff], previous_response_id: str | None,
                conversation_id: str | None, *, stream: bool) -> dict[str, Any]:
        """What the journal records and matches for one model call (see the module)."""
        items = [input] if isinstance(input, str) else input
        return {
            "model": self.name,
            "stream": stream,
            "instructions_sha256": digest(system_instructions),
            "input_items": len(items),
            "input_sha256": digest(items),
            "tools": [getattr(tool, "name", type(tool).__name__) for tool in tools],
            "handoffs": [handoff.tool_name for handoff in handoffs],
            "output_type": None if output_schema is None else output_schema.name(),
            "previous_response_id": previous_response_id,
            "conversation_id": conversation_id,
        }

    async def get_response(
        self, system_instructions: str | None, input: str | list[TResponseInputItem],
        model_settings: ModelSettings, tools: list[Tool],
        output_schema: AgentOutputSchemaBase | None, handoffs: list[Handoff],
        tracing: ModelTracing, *, previous_response_id: str | None,
        conversation_id: str | None, prompt: ResponsePromptParam | None,
    ) -> ModelResponse:
        """The recorded response, else the wrapped model's, journaled first."""
        request = self.request(system_instructions, input, tools, output_schema, handoffs,
                               previous_response_id, conversation_id, stream=False)

        async def call(_request: Any) -> LlmResponse:
            response = await self.model.get_response(
                system_instructions, input, model_settings, tools, output_schema, handoffs,
                tracing, previous_response_id=previous_response_id,
                conversation_id=conversation_id, prompt=prompt)
            return LlmResponse(content=_responses.dump_python(response, mode="json"),
                               input_tokens=response.usage.input_tokens,
                               output_tokens=response.usage.output_tokens)

        await self._turn()
        recorded = await self.ctx.llm(self.name, call, request)
        return _responses.validate_python(recorded)

    async def stream_response(
        self, system_instructions: str | None, input: str | list[TResponseInputItem],
        model_settings: ModelSettings, tools: list[Tool],
        output_schema: AgentOutputSchemaBase | None, handoffs: list[Handoff],
        tracing: ModelTracing, *, previous_response_id: str | None,
        conversation_id: str | None, prompt: ResponsePromptParam | None,
    ) -> AsyncIterator[TResponseStreamEvent]:
        """The recorded stream events, else the wrapped model's, journaled whole."""
        request = self.request(system_instructions, input, tools, output_schema, handoffs,
                               previous_response_id, conversation_id, stream=True)

        async def call(_request: Any) -> LlmResponse:
            events = [event async for event in self.model.stream_response(
                system_instructions, input, model_settings, tools, output_schema, handoffs,
                tracing, previous_response_id=previous_response_id,
                conversation_id=conversation_id, prompt=prompt)]
            input_tokens, output_tokens = _stream_usage(events)
            return LlmResponse(content=_stream_events.dump_python(events, mode="json"),
                               input_tokens=input_tokens, output_tokens=output_tokens)

        await self._turn()
        recorded = await self.ctx.llm(self.name, call, request)
        for event in _stream_events.validate_python(recorded):
            yield event

    async def _turn(self) -> None:
        if self.checkpoint_each_turn:
            await self.ctx.checkpoint(next_action={"model": self.name})


def _stream_usage(events: list[TResponseStreamEvent]) -> tuple[int, int]:
    """Token usage of a streamed response (from its ``response.completed`` event)."""
    for event in reversed(events):
        response = getattr(event, "response", None)
        usage = getattr(response, "usage", None)
        if getattr(event, "type", None) == "response.completed" and usage is not None:
            return int(usage.input_tokens), int(usage.output_tokens)
    return 0, 0


class DurableModelProvider(ModelProvider):
    """A model provider whose models are :class:`DurableModel` s (for agents that name
    their model by a string, resolved through the run config's provider)."""

    def __init__(self, ctx: AgentContext, provider: ModelProvider, *,
                 checkpoint_each_turn: bool = True) -> None:
        """Wrap ``provider`` for the task of ``ctx``."""
        self.ctx = ctx
        self.provider = provider
        self.checkpoint_each_turn = checkpoint_each_turn

    def get_model(self, model_name: str | None) -> Model:
        """The provider's model for ``model_name``, journaled."""
        model = self.provider.get_model(model_name)
        return DurableModel(self.ctx, model, name=model_label(model, model_name),
                            checkpoint_each_turn=self.checkpoint_each_turn)

    async def aclose(self) -> None:
        """Close the wrapped provider."""
        await self.provider.aclose()
