"""Chat messages -> one prompt, with the target's chat template.

The template is the ``chat_template`` of the tokenizer's ``tokenizer_config.json`` (or
``chat_template.jinja`` beside it), rendered by ``transformers``'
``apply_chat_template``, as vLLM renders it; ``--chat-template`` replaces it. A
tokenizer without one gets no made-up format: chat requests are refused with an error
that says how to give one.

The Triton ``tokenizer`` model encodes the prompt with the tokenizer's special tokens
(a BOS where the tokenizer adds one). Templates often write the BOS themselves, so a
rendered prompt that starts with the BOS text loses it here, or the target would see
two (vLLM encodes chat prompts without special tokens for the same reason).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from specdec_openai.protocol import ChatMessage, RequestError


class ChatTemplate:
    """A tokenizer with a chat template; ``None`` template: chat is refused."""

    def __init__(self, tokenizer, template: str | None, source: str):
        self.tokenizer = tokenizer
        self.template = template
        self.source = source  # where the tokenizer came from, for error messages
        self._strip_bos = _adds_bos(tokenizer)

    @classmethod
    def load(cls, tokenizer_dir: str, template: str | None = None) -> ChatTemplate:
        """``template``: a Jinja string or a file holding one; ``None``: the tokenizer's own."""
        from specdec.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(tokenizer_dir)
        template = read_template(template) if template is not None else None
        return cls(tokenizer, template or getattr(tokenizer, "chat_template", None), tokenizer_dir)

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool, kwargs: dict[str, Any],
               tools: list[dict[str, Any]] | None = None) -> str:  # fmt: skip
        """The prompt; ``tools`` go to the template as transformers passes them (``tools=``)."""
        if not self.template:
            raise RequestError(
                f"the tokenizer at {self.source} has no chat template (no 'chat_template' in its "
                "tokenizer_config.json, no chat_template.jinja): start the server with --chat-template FILE, "
                "or use /v1/completions",
                "messages",
            )
        conversation = [_plain(message) for message in messages]
        try:
            prompt = self.tokenizer.apply_chat_template(
                conversation,
                chat_template=self.template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                **kwargs,
            )
        except Exception as err:  # the template's own raise_exception(), or a message it cannot render
            raise RequestError(f"the chat template cannot render these messages: {err}", "messages") from None
        bos = self.tokenizer.bos_token
        if self._strip_bos and bos and prompt.startswith(bos):
            prompt = prompt[len(bos) :]
        if not prompt:
            raise RequestError("the chat template rendered an empty prompt", "messages")
        return prompt


def _plain(message: ChatMessage) -> dict[str, Any]:
    """The message with text parts (``[{"type": "text", "text": ...}]``) joined into one string, as
    vLLM gives them to templates written for strings; other parts (images, audio) are refused."""
    fields = message.model_dump(exclude_none=True)
    if isinstance(message.content, list):
        texts = []
        for part in message.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"only text content parts are supported, got type {part.get('type')!r}", "messages")
            texts.append(part["text"])
        fields["content"] = "\n".join(texts)
    for call in fields.get("tool_calls") or []:  # templates take a call's arguments as an object, as vLLM gives them
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except ValueError:
                raise RequestError("a tool call's 'arguments' in 'messages' must be JSON", "messages") from None
    return fields


def read_template(template: str) -> str:
    """A file's text, or ``template`` itself when it is Jinja; a path to no file is refused, not rendered as text
    (vLLM's rule)."""
    if os.path.isfile(template):
        return Path(template).read_text()
    if any(mark in template for mark in ("{{", "{%", "\n")):
        return template
    raise ValueError(f"chat template {template!r}: no such file, and not a Jinja template")


def _adds_bos(tokenizer) -> bool:
    """Whether encoding a prompt with special tokens puts the BOS first."""
    if tokenizer.bos_token_id is None:
        return False
    ids = tokenizer("a").input_ids
    return bool(ids) and ids[0] == tokenizer.bos_token_id
