"""Chat templates that render tools, for the tiny test models: a Qwen2-style one (hermes
`<tool_call>` blocks) and a Llama 3 style one (JSON calls, `ipython` tool results). Short, as
the tiny models' context is 512 tokens, but shaped as the real ones: tools given as
`tools=`, assistant `tool_calls` with their arguments as dicts, `tool` messages."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

QWEN2_TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n"
    'Reply <tool_call>\n{"name": <name>, "arguments": <args>}\n</tool_call><|im_end|>\n'
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{{ message.content or '' }}"
    '{% for call in message.tool_calls %}\n<tool_call>\n{"name": "{{ call.function.name }}", '
    '"arguments": {{ call.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n'
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}"
    "\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

LLAMA3_TOOLS_TEMPLATE = (
    "<|begin_of_text|>"
    "{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nCall a function as "
    '{"name": name, "parameters": args}:\n'
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}<|eot_id|>{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' and message.tool_calls %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
    '{% for call in message.tool_calls %}{"name": "{{ call.function.name }}", '
    '"parameters": {{ call.function.arguments | tojson }}}{% endfor %}<|eot_id|>'
    "{% elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n"
    "{{ message.content }}<|eot_id|>"
    "{% else %}<|start_header_id|>{{ message.role }}<|end_header_id|>\n\n"
    "{{ message.content }}<|eot_id|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def set_chat_template(model_dir: Path, template: str) -> Path:
    """Gives the model folder's tokenizer `template`."""
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    config_path.write_text(json.dumps(config, indent=2))
    return model_dir


def tokenizer_folder(model_dir: Path, to: Path, template: str, model_type: str) -> Path:
    """A folder with `model_dir`'s tokenizer, `template` and a config.json saying
    `model_type`: what a router reads (it needs no weights)."""
    to.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(model_dir / name, to / name)
    config = json.loads((model_dir / "config.json").read_text())
    (to / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    return set_chat_template(to, template)
