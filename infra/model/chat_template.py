"""The served model's chat template, extended to render tools (so the stack's vLLM serves tool calls).

SmolLM2-135M-Instruct's own template (from its GGUF) is ChatML and ignores ``tools``: a request that offers tools
would be rendered as if it offered none, and a tool result or an assistant's tool call would not render at all.
`with_tools` wraps it: a conversation that offers tools is rendered in the Hermes function-calling format (the
tools as JSON inside ``<tools></tools>`` in the system turn, an assistant's calls as ``<tool_call>`` JSON, a tool's
result as a user turn in ``<tool_response>``), which vLLM's ``hermes`` tool-call parser reads back
(``--tool-call-parser hermes``); every other conversation is rendered by the original template, byte for byte, so
nothing recorded without tools changes.

The template is part of the model directory (``chat_template.jinja``) and so of the manifest's
``chat_template_sha256``: the envelope's artifacts name the template that rendered its prompt.
"""

from __future__ import annotations

from typing import Final

#: The system turn's words when the conversation has no system message (the original template's default).
DEFAULT_SYSTEM: Final = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

#: Rendered instead of the original template when the request offers tools (Hermes function-calling format).
TOOLS_BRANCH: Final = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- '" + DEFAULT_SYSTEM + "' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message['content'] %}{{- message['content'] + '\\n' }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- set call = tool_call.function if tool_call.function is defined else tool_call %}"
    "{%- set arguments = call.arguments if call.arguments is string else call.arguments | tojson %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' + arguments + '}\\n</tool_call>' }}"
    "{%- if not loop.last %}{{- '\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    "{% else %}"
)


def with_tools(original: str) -> str:
    """The original template with the tools branch in front: a conversation without tools renders exactly as the
    original renders it (the branch adds no character outside its ``if``)."""
    if original.startswith(TOOLS_BRANCH):
        return original
    return TOOLS_BRANCH + original + "{% endif %}"
