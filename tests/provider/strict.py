"""Strict mode: refuse what the real APIs refuse, with the status, type and message they send.

A lenient simulator proves nothing about the real providers: the proxy once sent every Claude
Code request with `context_management` thinking edits but without `thinking`, which the real
API answers with 400, and the suite stayed green. With `ProviderSimulator(strict=True)` (the
default of the test fixtures) each model request is checked against the rules below before a
reply is taken; the first broken rule answers as the provider would, and nothing is sampled.

Every rule cites where the provider documents it (API reference, a guide, or the verbatim
error as users reported it from the live API). The simulator's model facts are its own small
tables, deliberately not the proxy's `dialects/models.json`: a wrong row there must show up as
a refusal here, not agree with itself. A model this file does not know gets only the rules
that hold for every model of its provider, as the proxy's table treats unknown models.

`refuse` adds rules a test wants (`{"some-model": {"temperature"}}`: that model answers any
`temperature` with the provider's unsupported-parameter error), to exercise the proxy's
provider feedback on a model nobody's table knows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .reply import Reply

# --------------------------------------------------------------------------------- sources

ANTHROPIC_MESSAGES = "https://docs.claude.com/en/api/messages"
ANTHROPIC_THINKING = "https://docs.claude.com/en/docs/build-with-claude/extended-thinking"
ANTHROPIC_ADAPTIVE = "https://platform.claude.com/docs/en/build-with-claude/adaptive-thinking"
ANTHROPIC_CONTEXT_EDITING = "https://platform.claude.com/docs/en/build-with-claude/context-editing"
ANTHROPIC_TOOL_WORKFLOWS = "https://platform.claude.com/docs/build-with-claude/thinking-tool-workflows"
ANTHROPIC_MIGRATING_45 = "https://platform.claude.com/docs/en/about-claude/models/migrating-to-claude-4"
GEMINI_REQUEST = "https://ai.google.dev/api/generate-content#request-body"
GEMINI_CONFIG = "https://ai.google.dev/api/generate-content#generationconfig"
GEMINI_THINKING = "https://ai.google.dev/gemini-api/docs/thinking"
OPENAI_CHAT = "https://platform.openai.com/docs/api-reference/chat/create"
OPENAI_RESPONSES = "https://platform.openai.com/docs/api-reference/responses/create"
OPENAI_REASONING = "https://platform.openai.com/docs/guides/reasoning"
ANTHROPIC_MODELS = "https://platform.claude.com/docs/en/about-claude/models/overview"

MAX_OUTPUT_TOKENS = 128_000  # the largest output any Claude model accepts (ANTHROPIC_MODELS)


@dataclass(frozen=True, slots=True)
class Refusal:
    """One broken rule: what the provider answers (always 400 here) and which rule it was."""

    rule: str
    message: str
    param: str | None = None
    code: str | None = None
    status: int = 400

    def reply(self) -> Reply:
        return Reply(status=self.status, error_type="invalid_request_error", error_message=self.message,
                     error_code=self.code, error_param=self.param, should_retry=False)


# ------------------------------------------------------------------------- model facts


def _name(model: Any) -> str:
    return str(model or "").rsplit("/", 1)[-1].lower()


# Anthropic families, by id prefix. `exclusive`: temperature and top_p cannot both be set
# (Claude 4.5 migration guide: "Use only temperature OR top_p, not both"; the live API says
# "`temperature` and `top_p` cannot both be specified for this model. Please use only one.",
# reported for Opus 4.1, Sonnet/Haiku/Opus 4.5 and Sonnet 4.6, e.g.
# https://github.com/langfuse/langfuse/issues/9882, https://github.com/Vali-98/ChatterUI/issues/564).
# `no_sampling`: temperature/top_p/top_k refused outright ("`temperature` is deprecated for this
# model.", Opus 4.7: https://github.com/Comfy-Org/ComfyUI/issues/13923,
# https://github.com/sipeed/picoclaw/issues/2939). `adaptive`: "yes" (adaptive and enabled),
# "only" (enabled refused), "no" (adaptive refused), per the adaptive-thinking page's
# supported-models list (ANTHROPIC_ADAPTIVE).
_ANTHROPIC_FAMILIES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("claude-mythos", {"no_sampling": True, "adaptive": "only", "no_disabled": True}),
    ("claude-fable", {"no_sampling": True, "adaptive": "only", "no_disabled": True}),
    ("claude-opus-5", {"no_sampling": True, "adaptive": "only"}),
    ("claude-sonnet-5", {"no_sampling": True, "adaptive": "only"}),
    ("claude-haiku-5", {"no_sampling": True, "adaptive": "only"}),
    ("claude-opus-4-8", {"no_sampling": True, "adaptive": "only"}),
    ("claude-opus-4-7", {"no_sampling": True, "adaptive": "only"}),
    ("claude-opus-4-6", {"exclusive": True, "adaptive": "yes"}),
    ("claude-sonnet-4-6", {"exclusive": True, "adaptive": "yes"}),
    ("claude-opus-4-5", {"exclusive": True, "adaptive": "no"}),
    ("claude-sonnet-4-5", {"exclusive": True, "adaptive": "no"}),
    ("claude-haiku-4-5", {"exclusive": True, "adaptive": "no"}),
    ("claude-opus-4-1", {"exclusive": True, "adaptive": "no"}),
    ("claude-opus-4", {"adaptive": "no"}),
    ("claude-sonnet-4", {"adaptive": "no"}),
    ("claude-3", {"adaptive": "no"}),
)


# The most output tokens each family writes (`max_output`), where it is below
# MAX_OUTPUT_TOKENS: each model's page lists "Max output" (ANTHROPIC_MODELS, e.g.
# https://platform.claude.com/docs/en/models/sonnet-4-5/overview: 64K; Opus 4.1 and 4: 32K),
# and the live API refuses more: "max_tokens: 65536 > 64000, which is the maximum allowed number
# of output tokens for claude-sonnet-4-5-20250929"
# (https://github.com/Natively-AI-assistant/natively-cluely-ai-assistant/issues/54,
# https://github.com/BerriAI/litellm/pull/15715). First matching prefix wins.
_ANTHROPIC_OUTPUT: tuple[tuple[str, int], ...] = (
    ("claude-opus-4-5", 64_000), ("claude-sonnet-4-5", 64_000), ("claude-haiku-4-5", 64_000),
    ("claude-opus-4-1", 32_000), ("claude-opus-4-6", MAX_OUTPUT_TOKENS), ("claude-sonnet-4-6", MAX_OUTPUT_TOKENS),
    ("claude-opus-4-7", MAX_OUTPUT_TOKENS), ("claude-opus-4-8", MAX_OUTPUT_TOKENS),
    ("claude-opus-4", 32_000), ("claude-sonnet-4", 64_000),
)


def anthropic_max_output(model: Any) -> int:
    name = _name(model)
    return next((cap for prefix, cap in _ANTHROPIC_OUTPUT if name.startswith(prefix)), MAX_OUTPUT_TOKENS)


def anthropic_facts(model: Any) -> dict[str, Any]:
    name = _name(model)
    for prefix, facts in _ANTHROPIC_FAMILIES:
        if name.startswith(prefix):
            return facts
    return {}


def openai_reasoning(model: Any) -> bool | None:
    """True for OpenAI's reasoning models (o-series, gpt-5 and later but the `-chat` ones),
    False for the known non-reasoning ones, None for a model this file does not know
    (OPENAI_REASONING; Codex 0.171's default `gpt-6.2-sol` is a gpt-6 reasoning model)."""
    name = _name(model)
    if name.startswith(("o1", "o3", "o4")) or (name.startswith(("gpt-5", "gpt-6")) and "-chat" not in name):
        return True
    if name.startswith(("gpt-4", "gpt-3.5", "chatgpt-4o")) or (name.startswith("gpt-5") and "-chat" in name):
        return False
    return None


# ------------------------------------------------------------------------- Anthropic

# The Messages request body (ANTHROPIC_MESSAGES); anything else is "<key>: Extra inputs are
# not permitted" (the live API's wording, e.g. https://github.com/amrit110/oli/issues/7).
ANTHROPIC_FIELDS = frozenset({
    "model", "messages", "max_tokens", "system", "metadata", "stop_sequences", "stream", "temperature",
    "top_p", "top_k", "tools", "tool_choice", "thinking", "service_tier", "container", "mcp_servers",
    "context_management", "output_config", "output_format", "inference_geo", "cache_control",
    # Sent by Claude Code 2.1.332 on every request (with its betas); the real API takes it,
    # or Claude Code would not work at all.
    "diagnostics",
})


def _thinking_on(thinking: Any) -> bool:
    return isinstance(thinking, dict) and thinking.get("type") in ("enabled", "adaptive")


def check_anthropic(body: dict[str, Any], refuse: set[str]) -> Refusal | None:
    model = body.get("model")
    facts = anthropic_facts(model)
    for key in body:
        if key not in ANTHROPIC_FIELDS:
            return Refusal("unknown_field", f"{key}: Extra inputs are not permitted")
    for key in sorted(refuse):
        if key in body:
            return Refusal("configured", f"`{key}` is not supported for this model.")
    # max_tokens is required and bounded (ANTHROPIC_MESSAGES: "max_tokens integer required", x >= 1).
    max_tokens = body.get("max_tokens")
    if "max_tokens" not in body:
        return Refusal("max_tokens_required", "max_tokens: Field required")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        return Refusal("max_tokens_range", "max_tokens: Input should be greater than or equal to 1")
    if max_tokens > MAX_OUTPUT_TOKENS:
        return Refusal("max_tokens_range", f"max_tokens: {max_tokens} > {MAX_OUTPUT_TOKENS}, which is the maximum "
                                           f"allowed number of output tokens for {model}")
    cap = anthropic_max_output(model)
    if max_tokens > cap:  # the model's own cap (_ANTHROPIC_OUTPUT)
        return Refusal("max_tokens_model", f"max_tokens: {max_tokens} > {cap}, which is the maximum allowed number "
                                           f"of output tokens for {model}")
    # Newer models refuse the sampling parameters outright (see _ANTHROPIC_FAMILIES).
    if facts.get("no_sampling"):
        for key in ("temperature", "top_p", "top_k"):
            if key in body:
                return Refusal("sampling_removed", f"`{key}` is deprecated for this model.")
    # temperature and top_p exclusive on the 4.1-4.6 families (ANTHROPIC_MIGRATING_45).
    if facts.get("exclusive") and body.get("temperature") is not None and body.get("top_p") is not None:
        return Refusal("temperature_top_p", "`temperature` and `top_p` cannot both be specified for this model. "
                                            "Please use only one.")
    temperature = body.get("temperature")
    if temperature is not None and not (isinstance(temperature, (int, float)) and 0 <= temperature <= 1):
        return Refusal("temperature_range", "temperature: Input should be less than or equal to 1")
    thinking = body.get("thinking")
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if thinking is not None and kind not in ("enabled", "adaptive", "disabled"):
        return Refusal("thinking_type", "thinking: Input tag does not match any of the expected tags: "
                                        "'enabled', 'disabled', 'adaptive'")
    # Which thinking modes a model takes (ANTHROPIC_ADAPTIVE, "Supported models").
    if kind == "enabled" and facts.get("adaptive") == "only":
        return Refusal("thinking_mode", '"thinking.type.enabled" is not supported for this model. Use '
                                        '"thinking.type.adaptive" and "output_config.effort" to control thinking '
                                        "behavior.")
    if kind == "disabled" and facts.get("no_disabled"):
        return Refusal("thinking_mode", '"thinking.type.disabled" is not supported for this model.')
    if kind == "adaptive" and facts.get("adaptive") == "no":
        return Refusal("thinking_mode", "adaptive thinking is not supported on this model")
    if _thinking_on(thinking):
        refusal = _check_thinking(body, thinking, max_tokens)
        if refusal:
            return refusal
    # Thinking-block clearing needs thinking (ANTHROPIC_CONTEXT_EDITING, "Thinking block
    # clearing"; the refusal's text is the live API's).
    edits = (body.get("context_management") or {}).get("edits") if isinstance(body.get("context_management"), dict) else None
    for edit in edits or []:
        etype = str((edit or {}).get("type", ""))
        if etype.startswith("clear_thinking_") and not _thinking_on(thinking):
            return Refusal("clear_thinking_requires_thinking",
                           f"`{etype}` strategy requires `thinking` to be enabled or adaptive")
    return _check_history(body.get("messages"), thinking)


def _check_thinking(body: dict[str, Any], thinking: dict[str, Any], max_tokens: int) -> Refusal | None:
    """ANTHROPIC_THINKING, "Feature compatibility": thinking isn't compatible with temperature or
    top_k modifications or forced tool use; top_p only between 0.95 and 1; budget_tokens at
    least 1024 and below max_tokens."""
    temperature = body.get("temperature")
    if temperature is not None and temperature != 1:
        return Refusal("thinking_temperature", "`temperature` may only be set to 1 when thinking is enabled or in "
                                               "adaptive mode. Please consult our documentation at "
                                               f"{ANTHROPIC_THINKING}#important-considerations-when-using-extended-thinking")
    if body.get("top_k") is not None:
        return Refusal("thinking_top_k", "`top_k` is not supported when thinking is enabled or in adaptive mode.")
    top_p = body.get("top_p")
    if top_p is not None and not 0.95 <= top_p <= 1:
        return Refusal("thinking_top_p", "`top_p` must be greater than or equal to 0.95 or unset when thinking is "
                                         "enabled or in adaptive mode.")
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") in ("any", "tool"):
        return Refusal("thinking_tool_choice", "Thinking may not be enabled when tool_choice forces tool use.")
    if thinking.get("type") == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or budget < 1024:
            return Refusal("thinking_budget", "thinking.enabled.budget_tokens: Input should be greater than or equal "
                                              "to 1024")
        if budget >= max_tokens:
            return Refusal("thinking_budget", "`max_tokens` must be greater than `thinking.budget_tokens`. Please "
                                              f"consult our documentation at {ANTHROPIC_THINKING}#max-tokens-and-"
                                              "context-window-size")
    return None


def _check_history(messages: Any, thinking: Any) -> Refusal | None:
    """Thinking blocks handed back must carry their signature (ANTHROPIC_THINKING, "Preserving
    thinking blocks": signatures are verified), and with thinking on, the last assistant turn of
    a tool-use loop must start with its thinking block (the API's message, as it words it)."""
    if not isinstance(messages, list):
        return Refusal("messages", "messages: Input should be a valid list")
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        for j, block in enumerate(content if isinstance(content, list) else []):
            if isinstance(block, dict) and block.get("type") == "thinking" and not block.get("signature"):
                return Refusal("thinking_signature", f"messages.{i}.content.{j}.thinking.signature: Field required")
    if not _thinking_on(thinking):
        # With thinking off, no thinking in an assistant message in the final position (the
        # live API's words: https://github.com/tailcallhq/forgecode/issues/1853,
        # https://github.com/microsoft/vscode/issues/282326; one thinking configuration per
        # assistant turn, ANTHROPIC_TOOL_WORKFLOWS).
        last = messages[-1] if messages else None
        content = last.get("content") if isinstance(last, dict) and last.get("role") == "assistant" else None
        for j, block in enumerate(content if isinstance(content, list) else []):
            if isinstance(block, dict) and block.get("type") in ("thinking", "redacted_thinking"):
                return Refusal("thinking_disabled_history",
                               f"messages.{len(messages) - 1}.content.{j}: When thinking is disabled, an `assistant` "
                               "message in the final position cannot contain `thinking`. To use thinking blocks, "
                               "enable `thinking` in your request.")
        return None
    if len(messages) < 2:
        return None
    last, before = messages[-1], messages[-2]
    results = isinstance(last.get("content"), list) and any(
        isinstance(b, dict) and b.get("type") == "tool_result" for b in last["content"])
    blocks = before.get("content") if before.get("role") == "assistant" else None
    if results and isinstance(blocks, list) and blocks:
        first = blocks[0].get("type") if isinstance(blocks[0], dict) else None
        if first not in ("thinking", "redacted_thinking"):
            return Refusal("thinking_history",
                           f"messages.{len(messages) - 2}.content.0.type: Expected `thinking` or `redacted_thinking`, "
                           f"but found `{first}`. When `thinking` is enabled, a final `assistant` message must start "
                           "with a thinking block (preceeding the lastmost set of `tool_use` and `tool_result` "
                           "blocks). We recommend you include thinking blocks from previous turns. To avoid this "
                           "requirement, disable `thinking`. Please consult our documentation at "
                           f"{ANTHROPIC_THINKING}")
    return None


# ----------------------------------------------------------------------------- OpenAI

# OPENAI_CHAT request body; anything else is "Unrecognized request argument supplied: <key>".
CHAT_FIELDS = frozenset({
    "model", "messages", "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs",
    "max_completion_tokens", "max_tokens", "metadata", "modalities", "n", "parallel_tool_calls", "prediction",
    "presence_penalty", "prompt_cache_key", "prompt_cache_retention", "reasoning_effort", "response_format",
    "safety_identifier", "seed", "service_tier", "stop", "store", "stream", "stream_options", "temperature",
    "tool_choice", "tools", "top_logprobs", "top_p", "user", "verbosity", "web_search_options",
})
# OPENAI_RESPONSES request body; anything else is "Unknown parameter: '<key>'." (code
# unknown_parameter). `type`/`generate`/`client_metadata` arrive only in WebSocket frames.
RESPONSES_FIELDS = frozenset({
    "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "max_tool_calls", "stream",
    "stream_options", "store", "previous_response_id", "conversation", "reasoning", "include", "text", "temperature",
    "top_p", "top_logprobs", "max_output_tokens", "metadata", "truncation", "user", "service_tier",
    "prompt_cache_key", "prompt_cache_retention", "safety_identifier", "background", "prompt", "context_management",
    "client_metadata",
})
# Refused by reasoning models in Chat (OPENAI_REASONING, "Limitations"; the live API's
# words e.g. https://github.com/IBM/chuk-llm/issues/3, https://github.com/decolua/9router/issues/560).
_CHAT_REASONING_REFUSED = ("presence_penalty", "frequency_penalty", "logprobs", "top_logprobs", "logit_bias")


def _unsupported(key: str, extra: str = "") -> Refusal:
    return Refusal("unsupported_parameter", f"Unsupported parameter: '{key}' is not supported with this model.{extra}",
                   param=key, code="unsupported_parameter")


def check_chat(body: dict[str, Any], refuse: set[str]) -> Refusal | None:
    for key in body:
        if key not in CHAT_FIELDS:
            return Refusal("unknown_field", f"Unrecognized request argument supplied: {key}")
    for key in sorted(refuse):
        if key in body:
            return _unsupported(key)
    reasoning = openai_reasoning(body.get("model"))
    if reasoning:
        if "max_tokens" in body:
            return _unsupported("max_tokens", " Use 'max_completion_tokens' instead.")
        for key in ("temperature", "top_p"):
            value = body.get(key)
            if value is not None and value != 1:
                return Refusal("reasoning_sampling", f"Unsupported value: '{key}' does not support {value} with this "
                                                     "model. Only the default (1) value is supported.",
                               param=key, code="unsupported_value")
        for key in _CHAT_REASONING_REFUSED:
            if key in body:
                return _unsupported(key)
    elif reasoning is False and body.get("reasoning_effort") is not None:
        return _unsupported("reasoning_effort")
    return None


def check_responses(body: dict[str, Any], refuse: set[str], *, frame: bool = False) -> Refusal | None:
    if "reasoning_effort" in body:
        return Refusal("moved_parameter", "Unsupported parameter: 'reasoning_effort'. In the Responses API, this "
                                          "parameter has moved to 'reasoning.effort'. Try again with the new "
                                          "parameter. See the API documentation for more information: "
                                          f"{OPENAI_RESPONSES}.", code="unsupported_parameter")
    for key in body:
        if key not in RESPONSES_FIELDS and not (frame and key in ("type", "generate")):
            return Refusal("unknown_field", f"Unknown parameter: '{key}'.", param=key, code="unknown_parameter")
    for key in sorted(refuse):
        if key in body:
            return _unsupported(key)
    reasoning = openai_reasoning(body.get("model"))
    if reasoning:
        # Reasoning models take no sampling parameters in Responses (OPENAI_REASONING).
        for key in ("temperature", "top_p"):
            if body.get(key) is not None and body.get(key) != 1:
                return _unsupported(key)
    elif reasoning is False and isinstance(body.get("reasoning"), dict):
        # https://github.com/RageAgainstThePixel/OpenAI-DotNet/issues/500 (gpt-4o), BoundaryML/baml#2708 (gpt-4.1).
        for key in ("effort", "summary"):
            if body["reasoning"].get(key) is not None:
                return _unsupported(f"reasoning.{key}")
    return None


# ----------------------------------------------------------------------------- Gemini

# GEMINI_REQUEST: the GenerateContentRequest body. The JSON API takes each field in lowerCamel
# or snake_case (proto3 JSON mapping); anything else is 'Invalid JSON payload received. Unknown
# name "<key>": Cannot find field.' (the live API's words, e.g.
# https://github.com/google-gemini/gemini-cli/issues/1035, https://github.com/BerriAI/litellm/issues/7830).
_GEMINI_FIELDS = ("contents", "tools", "toolConfig", "safetySettings", "systemInstruction", "generationConfig",
                  "cachedContent", "model", "labels")
# GEMINI_CONFIG: GenerationConfig's fields (and ThinkingConfig's).
_GEMINI_CONFIG_FIELDS = (
    "stopSequences", "responseMimeType", "responseSchema", "responseJsonSchema", "_responseJsonSchema",
    "responseModalities", "candidateCount", "maxOutputTokens", "temperature", "topP", "topK", "seed",
    "presencePenalty", "frequencyPenalty", "responseLogprobs", "logprobs", "enableEnhancedCivicAnswers",
    "speechConfig", "thinkingConfig", "imageConfig", "mediaResolution", "routingConfig", "audioTimestamp")
_GEMINI_THINKING_FIELDS = ("includeThoughts", "thinkingBudget", "thinkingLevel")


def _snake(name: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in name).lstrip("_") if name[0] != "_" else name


def _spellings(fields: tuple[str, ...]) -> frozenset[str]:
    return frozenset(fields) | {_snake(f) for f in fields}


GEMINI_FIELDS = _spellings(_GEMINI_FIELDS)
GEMINI_CONFIG_FIELDS = _spellings(_GEMINI_CONFIG_FIELDS)
GEMINI_THINKING_FIELDS = _spellings(_GEMINI_THINKING_FIELDS)

# GEMINI_THINKING, "Set budgets" and "Thinking levels": per family, the thinkingBudget range
# (-1 is dynamic everywhere), whether 0 (no thinking) is taken, and the thinkingLevel values
# (none before Gemini 3: "If you use thinkingLevel with a model earlier than Gemini 3, the model
# returns an error"). First matching prefix wins. The live API's words: "The thinking budget
# (52428) is invalid." (https://github.com/RooCodeInc/Roo-Code/issues/4399); "Budget 0 is
# invalid. This model only works in thinking mode." (https://github.com/vercel/ai/issues/8027
# for 2.5 Pro, https://github.com/docker/docker-agent/issues/2051 for 3.1 Pro).
_GEMINI_FAMILIES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("gemini-2.5-pro", {"budget": (128, 32768), "off": False, "levels": ()}),
    ("gemini-2.5-flash-lite", {"budget": (512, 24576), "off": True, "levels": ()}),
    ("gemini-2.5-flash", {"budget": (1, 24576), "off": True, "levels": ()}),
    ("gemini-2.", {"levels": ()}),
    ("gemini-3-pro", {"off": False, "levels": ("low", "high")}),
    ("gemini-3", {"off": False, "levels_by_kind": {"pro": ("low", "medium", "high"),
                                                   "flash": ("minimal", "low", "medium", "high")}}),
)


def gemini_facts(model: Any) -> dict[str, Any]:
    name = _name(model)
    for prefix, facts in _GEMINI_FAMILIES:
        if name.startswith(prefix):
            out = dict(facts)
            for kind, levels in out.pop("levels_by_kind", {}).items():
                if kind in name:
                    out["levels"] = levels
            return out
    return {}


def _invalid(message: str) -> Refusal:
    return Refusal("gemini_invalid", message, code="INVALID_ARGUMENT")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_gemini(body: dict[str, Any], model: Any, refuse: set[str]) -> Refusal | None:
    """GEMINI_REQUEST, GEMINI_CONFIG and GEMINI_THINKING, in the order the API reads a body:
    unknown fields first (the JSON decoder), then the values."""
    for key in body:
        if key not in GEMINI_FIELDS:
            return Refusal("unknown_field", f'Invalid JSON payload received. Unknown name "{key}": Cannot find field.')
    config = body.get("generationConfig", body.get("generation_config")) or {}
    if not isinstance(config, dict):
        return Refusal("unknown_field", "Invalid JSON payload received. generation_config: Proto field is not "
                                        "repeating, cannot start list.")
    for key in config:
        if key not in GEMINI_CONFIG_FIELDS:
            return Refusal("unknown_field", f'Invalid JSON payload received. Unknown name "{key}" at '
                                            "'generation_config': Cannot find field.")
    thinking = config.get("thinkingConfig", config.get("thinking_config")) or {}
    for key in thinking if isinstance(thinking, dict) else ():
        if key not in GEMINI_THINKING_FIELDS:
            return Refusal("unknown_field", f'Invalid JSON payload received. Unknown name "{key}" at '
                                            "'generation_config.thinking_config': Cannot find field.")
    for key in sorted(refuse):
        if key in config:
            return Refusal("configured", f"* GenerateContentRequest.generation_config.{_snake(key)}: {_snake(key)} is "
                                         "not supported for this model.", code="INVALID_ARGUMENT")

    def get(name: str) -> Any:
        return config.get(name, config.get(_snake(name)))

    # Ranges (GEMINI_CONFIG): temperature [0.0, 2.0], topP [0.0, 1.0], candidateCount 1-8,
    # at most 5 stop sequences, logprobs [0, 20] and only with responseLogprobs, a positive
    # maxOutputTokens and topK. The API's words for a field out of range are not captured
    # here; the message names the field as its other field errors do.
    for name, low, high in (("temperature", 0, 2), ("topP", 0, 1), ("candidateCount", 1, 8),
                            ("logprobs", 0, 20)):
        value = get(name)
        if value is not None and not (_number(value) and low <= value <= high):
            return Refusal("gemini_range", f"* GenerateContentRequest.generation_config.{_snake(name)}: "
                                           f"{value} is out of range [{low}, {high}]", code="INVALID_ARGUMENT")
    for name in ("maxOutputTokens", "topK"):
        value = get(name)
        if value is not None and not (_number(value) and value >= 1):
            return Refusal("gemini_range", f"* GenerateContentRequest.generation_config.{_snake(name)}: must be "
                                           "positive", code="INVALID_ARGUMENT")
    stops = get("stopSequences")
    if isinstance(stops, list) and len(stops) > 5:
        return Refusal("gemini_range", "* GenerateContentRequest.generation_config.stop_sequences: at most 5 stop "
                                       "sequences are supported", code="INVALID_ARGUMENT")
    if get("logprobs") is not None and not get("responseLogprobs"):
        return Refusal("gemini_logprobs", "logprobs is only valid if response_logprobs is true.",
                       code="INVALID_ARGUMENT")
    if isinstance(thinking, dict):
        return _check_gemini_thinking(thinking, gemini_facts(model))
    return None


def _check_gemini_thinking(thinking: dict[str, Any], facts: dict[str, Any]) -> Refusal | None:
    budget = thinking.get("thinkingBudget", thinking.get("thinking_budget"))
    level = thinking.get("thinkingLevel", thinking.get("thinking_level"))
    # GEMINI_THINKING, "Thinking levels and budgets": one or the other, never both.
    if budget is not None and level is not None:
        return Refusal("gemini_thinking_both", "You can only set only one of thinking budget and thinking level.",
                       code="INVALID_ARGUMENT")
    levels = facts.get("levels")
    if level is not None and levels is not None and str(level).lower() not in levels:
        if not levels:
            return Refusal("gemini_thinking_level", "Thinking level is not supported for this model.",
                           code="INVALID_ARGUMENT")
        return Refusal("gemini_thinking_level", f"Thinking level {level} is not supported for this model. Supported "
                                                f"levels: {', '.join(levels)}.", code="INVALID_ARGUMENT")
    if budget is None or budget == -1:
        return None
    if not isinstance(budget, int) or isinstance(budget, bool):
        return Refusal("gemini_thinking_budget", f"The thinking budget ({budget}) is invalid.", code="INVALID_ARGUMENT")
    if budget == 0 and facts.get("off") is False:
        return Refusal("gemini_thinking_budget", "Budget 0 is invalid. This model only works in thinking mode.",
                       code="INVALID_ARGUMENT")
    low, high = facts.get("budget") or (0, None)
    if budget < 0 or (budget != 0 and budget < low) or (high is not None and budget > high):
        return Refusal("gemini_thinking_budget", f"The thinking budget ({budget}) is invalid.", code="INVALID_ARGUMENT")
    return None


def check(route: str | None, body: Any, refuse: Mapping[str, set[str]] | None = None, *,
          frame: bool = False, model: str | None = None) -> Refusal | None:
    """The first rule `body` breaks on `route` ("messages", "chat", "responses", "gemini"), or
    None. Gemini names its model in the path: `model`."""
    if not isinstance(body, dict):
        return None
    if route == "gemini":
        return check_gemini(body, model, set((refuse or {}).get(str(model), ())))
    wanted = set((refuse or {}).get(str(body.get("model")), ()))
    if route == "messages":
        return check_anthropic(body, wanted)
    if route == "chat":
        return check_chat(body, wanted)
    if route == "responses":
        return check_responses(body, wanted, frame=frame)
    return None
