"""Chat templates that read a message's content only as a list of parts.

Records hold each message's content as a string with ``<image>`` placeholders inline
(LLaVA's JSON form, and what :class:`~mmcache.transforms.chat.ChatSpec` labels). Some
models' own templates render only the list form of ``transformers`` processors::

    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]}

(``llava-hf/llava-1.5-*-hf`` renders every image part as ``<image>\\n`` before the text
parts; a string content renders as nothing). :func:`as_parts` turns a string content
into that list: each placeholder an ``{"type": "image"}`` part, the text between them
``{"type": "text"}`` parts, with the whitespace next to a placeholder dropped (the
template writes its own, as a processor user's parts have none). :func:`reads_parts`
tells, by rendering a probe conversation both ways, whether a template needs the list
form: the string form is kept whenever the template renders it (so a template that
reads both, such as Qwen2-VL's, renders what it always did).

Pure functions; thread-safe.
"""

from __future__ import annotations

from typing import Any

__all__ = ["as_parts", "parts_messages", "reads_parts"]

# Probe replies: private-use characters no template writes on its own.
_USER, _REPLY = "\ue010", "\ue011"


def as_parts(content: str, image_token: str) -> list[dict[str, str]]:
    """``content`` as a list of ``image`` and ``text`` parts (see the module docstring)."""
    pieces = content.split(image_token)
    parts: list[dict[str, str]] = []
    for i, raw in enumerate(pieces):
        text = raw
        if i > 0:
            parts.append({"type": "image"})
            text = text.lstrip()
        if i < len(pieces) - 1:
            text = text.rstrip()
        if text or len(pieces) == 1:
            parts.append({"type": "text", "text": text})
    return parts


def parts_messages(messages: list[dict[str, Any]], image_token: str) -> list[dict[str, Any]]:
    """Each message of ``messages`` with its string content as :func:`as_parts`."""
    return [
        {**m, "content": as_parts(m["content"], image_token)}
        if isinstance(m["content"], str)
        else m
        for m in messages
    ]


def reads_parts(render: Any, image_token: str) -> bool:
    """Whether the template ``render(messages) -> str`` needs the list form: True when a
    probe user turn and reply are missing from its render of string contents and present
    in its render of parts. A template that raises on either form decides nothing: False
    (the string form, as before)."""
    probe = [
        {"role": "user", "content": f"{image_token}\n{_USER}"},
        {"role": "assistant", "content": _REPLY},
    ]

    def shows(messages: list[dict[str, Any]]) -> bool:
        try:
            text = render(messages)
        except Exception:  # a template's own refusal (roles, system turn...): undecided
            return False
        return _USER in text and _REPLY in text

    return not shows(probe) and shows(parts_messages(probe, image_token))
