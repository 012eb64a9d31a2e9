"""Chat templates: the built-in ones and the Jinja environment that renders them as
``transformers`` does.

A template is a Jinja string in the Hugging Face ``chat_template`` format: it reads
``messages`` (a list of ``{"role", "content"}``), ``add_generation_prompt`` and the
tokenizer's special tokens (``bos_token``, ``eos_token``...). :func:`compile_template`
builds it in the environment of ``transformers.utils.chat_template_utils``: a
sandboxed, immutable environment with ``trim_blocks`` and ``lstrip_blocks``, the
``loopcontrols`` extension, ``raise_exception``, ``strftime_now``, a ``tojson`` that
does not escape HTML, and the ``{% generation %}`` tag (rendered as its body: labels
come from offsets here, not from the tag). So a model's own template renders to the
same text here as in ``apply_chat_template``.

:data:`BUILTIN_TEMPLATES` holds ``"chatml"``, ``"llama3"`` and ``"vicuna_v1"`` (LLaVA-1.5's
conversation format) with the end-of-turn marker each closes an assistant turn with.

jinja2 is imported on first use (the ``chat`` extra). Thread-safe: a compiled template
is immutable and may render from several threads at once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

from mmcache.errors import ConfigError

__all__ = ["BUILTIN_TEMPLATES", "BuiltinTemplate", "compile_template", "render"]


@dataclass(frozen=True)
class BuiltinTemplate:
    """A named template: its Jinja text, the marker that ends an assistant turn (trained
    on with the turn) and the special tokens it uses when the tokenizer names none."""

    text: str
    end_of_turn: str
    bos_token: str
    eos_token: str


_CHATML = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Meta-Llama-3-Instruct's template.
_LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

# LLaVA-1.5's conv_vicuna_v1: "<system> USER: q ASSISTANT: a</s>USER: ..."
_VICUNA_SYSTEM = (
    "A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user's questions."
)
_VICUNA_V1 = (
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set loop_messages = messages[1:] %}"
    "{% else %}{% set system = '" + _VICUNA_SYSTEM.replace("'", "\\'") + "' %}"
    "{% set loop_messages = messages %}{% endif %}"
    "{{ bos_token + system + ' ' }}"
    "{% for message in loop_messages %}"
    "{% if message['role'] == 'user' %}{{ 'USER: ' + message['content'] + ' ' }}"
    "{% elif message['role'] == 'assistant' %}{{ 'ASSISTANT: ' + message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('vicuna_v1 has no role ' + message['role']) }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

#: The built-in templates by name (``ChatSpec(template="chatml")``).
BUILTIN_TEMPLATES: dict[str, BuiltinTemplate] = {
    "chatml": BuiltinTemplate(_CHATML, "<|im_end|>", "", "<|im_end|>"),
    "llama3": BuiltinTemplate(_LLAMA3, "<|eot_id|>", "<|begin_of_text|>", "<|eot_id|>"),
    "vicuna_v1": BuiltinTemplate(_VICUNA_V1, "</s>", "<s>", "</s>"),
}


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def compile_template(text: str) -> Any:
    """``text`` compiled in transformers' chat-template environment (see the module
    docstring); ConfigError naming the problem for a template that does not parse or
    when jinja2 is missing."""
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as exc:  # pragma: no cover - jinja2 ships with the chat extra
        raise ConfigError("chat templates need jinja2: pip install 'mmcache[chat]'") from exc

    class _Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: rendered as its body."""

        tags = {"generation"}  # noqa: RUF012 (jinja's own attribute)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(
                lineno
            )

        def _body(self, caller: Any) -> str:
            return str(caller())

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(text)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ConfigError(f"the chat template does not parse: {exc} (line {exc.lineno})") from exc


def render(
    text: str,
    messages: list[dict[str, str]],
    special_tokens: dict[str, str],
    *,
    add_generation_prompt: bool = False,
) -> str:
    """``messages`` through the template ``text`` (``special_tokens`` as variables, as
    transformers passes its ``special_tokens_map``). Raises jinja2's errors
    (``TemplateError`` from ``raise_exception``)."""
    out: str = compile_template(text).render(
        messages=messages, add_generation_prompt=add_generation_prompt, **special_tokens
    )
    return out
