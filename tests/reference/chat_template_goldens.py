"""Golden chat-template renderings, produced the way `transformers` renders templates.

Usage: python tests/reference/chat_template_goldens.py
Needs jinja2. Reads mlxcel-tokenizer/tests/data/*.jinja and writes
mlxcel-tokenizer/tests/data/chat_template_goldens.json.
"""

import json
from datetime import datetime
from pathlib import Path

from jinja2.exceptions import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

DATA = Path(__file__).resolve().parents[2] / "mlxcel-tokenizer" / "tests" / "data"


def compile_template(source):
    """Mirrors transformers' `_compile_jinja_template`."""

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


SYSTEM = {"role": "system", "content": "You are a terse assistant."}
USER = {"role": "user", "content": "What is the capital of France?"}
ASSISTANT = {"role": "assistant", "content": "Paris."}
USER2 = {"role": "user", "content": "  And of Japan? 日本 🗾\nAnswer briefly.  "}

# Keys in sorted order at every level, so the Rust side renders them the same whether or
# not serde_json's `preserve_order` feature is on (without it, `serde_json::Value` sorts keys).
TOOLS = [
    {
        "function": {
            "description": "Current weather for a city — «quoted» \"text\"",
            "name": "get_weather",
            "parameters": {
                "properties": {"city": {"type": "string"}, "days": {"default": 1, "type": "integer"}},
                "required": ["city"],
                "type": "object",
            },
        },
        "type": "function",
    }
]

CONVERSATIONS = {
    "no_system": [USER],
    "with_system": [SYSTEM, USER],
    "multi_turn": [USER, ASSISTANT, USER2],
    "multi_turn_with_system": [SYSTEM, USER, ASSISTANT, USER2],
}

CASES = [
    # (template file, conversation, add_generation_prompt, tools)
    *[("smollm2_chat_template.jinja", conv, agp, None) for conv in CONVERSATIONS for agp in (True, False)],
    *[("hf_features_template.jinja", conv, agp, None) for conv in ("with_system", "multi_turn") for agp in (True, False)],
    ("hf_features_template.jinja", "multi_turn_with_system", True, TOOLS),
]

SPECIAL_TOKENS = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}


def main():
    cases = []
    for template_file, conversation, add_generation_prompt, tools in CASES:
        template = compile_template((DATA / template_file).read_text())
        messages = CONVERSATIONS[conversation]
        expected = template.render(
            messages=messages,
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **SPECIAL_TOKENS,
        )
        cases.append(
            {
                "template": template_file,
                "name": f"{conversation}/add_generation_prompt={add_generation_prompt}/tools={tools is not None}",
                "messages": messages,
                "tools": tools,
                "add_generation_prompt": add_generation_prompt,
                **SPECIAL_TOKENS,
                "expected": expected,
            }
        )
    out = DATA / "chat_template_goldens.json"
    out.write_text(json.dumps({"cases": cases}, ensure_ascii=False, indent=1) + "\n")
    print(f"wrote {len(cases)} cases to {out}")


if __name__ == "__main__":
    main()
