"""Tool-call parsers for ``tool_choice: "auto"``: the model writes its calls in its own syntax,
free (unconstrained), and the parser finds them in the finished text (vLLM's
``--enable-auto-tool-choice --tool-call-parser NAME``). Torch-free, FastAPI-free.

``hermes``: Hermes-style ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, as
the chat templates of Qwen2.5 and Qwen3 (and Hermes 2/3) ask for; the text before the first
block is the message's content. A block whose JSON does not parse, or lacks ``name``, leaves
the whole text as content. Other families' syntaxes (Llama 3's JSON, Mistral's
``[TOOL_CALLS]``, gpt-oss's harmony channels, DeepSeek's) have no parser yet.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ParsedCall:
    """One call a parser found: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


class HermesToolParser:
    """Finds ``<tool_call>{...}</tool_call>`` blocks (the last one may lack its end tag when
    generation stopped there)."""

    name = "hermes"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """``(content, calls)``: the text before the first call (None when empty) and the
        calls; ``(text, [])`` when there is no well-formed call."""
        start = text.find("<tool_call>")
        if start < 0:
            return text, []
        calls = []
        for block in self._BLOCK.findall(text[start:]):
            try:
                call = json.loads(block)
            except json.JSONDecodeError:
                return text, []
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return text, []
            arguments = call.get("arguments", call.get("parameters", {}))
            calls.append(ParsedCall(call["name"], arguments if isinstance(arguments, str)
                                    else json.dumps(arguments, ensure_ascii=False)))
        content = text[:start].strip()
        return content or None, calls


TOOL_PARSERS = {HermesToolParser.name: HermesToolParser}
