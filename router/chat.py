"""Chat messages -> one text prompt (and its images), with the checkpoint's chat template.

The template is the tokenizer's own (``chat_template`` in ``tokenizer_config.json`` or
``chat_template.jinja``), or the Jinja file given with ``--chat-template``. Images (LLaVA
targets) arrive as base64 ``data:`` URLs in ``image_url`` content parts; each becomes the
processor's image placeholder in the text, in order, and its bytes go to the request's
``images`` (docs/images.md). The rendered text is tokenized like any text prompt; a leading
BOS the template writes is dropped when the tokenizer adds one itself, so it is never doubled.
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path
from typing import Any

from specmesh.protocol.errors import InvalidRequestError
from specmesh.router.openai_schema import ChatMessage
from specmesh.router.tools import parser_for

DEFAULT_IMAGE_TOKEN = "<image>"


class ChatRenderer:
    def __init__(self, tokenizer: Any, template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.template = template  # Jinja source (`read_template`); None: the tokenizer's own
        self.image_token = getattr(tokenizer, "image_token", None) or DEFAULT_IMAGE_TOKEN
        bos = getattr(tokenizer, "bos_token", None)
        adds_bos = bool(bos) and tokenizer.encode("a")[:1] == [tokenizer.bos_token_id]
        self.strip_prefix = bos if adds_bos else None

    @property
    def tool_parser(self) -> str:
        """How ``auto`` tool calls are read from the output (`specmesh.router.tools`)."""
        return parser_for(self.template or getattr(self.tokenizer, "chat_template", None))

    def render(
        self, messages: list[dict], tools: list[dict] | None = None,
        add_generation_prompt: bool = True, strip_bos: bool = True,
    ) -> str:  # fmt: skip
        """The prompt text for ``messages`` (from `flatten`) and ``tools`` (OpenAI's tool
        objects, given to the template as ``tools``), ending with the assistant turn's start
        (``add_generation_prompt``); ``strip_bos``: without a BOS the template writes where
        the tokenizer adds one itself. Blocking (Jinja): call it off the event loop."""
        if self.template is None and not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError(
                "the model has no chat template: start the router with --chat-template FILE, "
                "or use /v1/completions"
            )
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools, chat_template=self.template, tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )  # fmt: skip
        except Exception as e:  # jinja's TemplateError, raise_exception() in templates
            raise InvalidRequestError(f"the chat template failed on these messages: {e}") from e
        if strip_bos and self.strip_prefix and text.startswith(self.strip_prefix):
            text = text[len(self.strip_prefix) :]
        return text

    def flatten(self, messages: list[ChatMessage]) -> tuple[list[dict], list[bytes]]:
        """Messages as ``{"role", "content": str}`` dicts, image parts replaced by the image
        placeholder; the images' bytes in order."""
        out, images = [], []
        for i, msg in enumerate(messages):
            if msg.content is None or isinstance(msg.content, str):
                text = msg.content or ""
            else:
                pieces = []
                for part in msg.content:
                    if part.type == "text":
                        pieces.append(part.text or "")
                    else:
                        images.append(decode_data_url(part.image_url, f"messages[{i}]"))
                        pieces.append(self.image_token)
                text = "".join(pieces)
            entry = {"role": msg.role, "content": text}
            for key in ("name", "tool_calls", "tool_call_id"):
                if getattr(msg, key) is not None:
                    entry[key] = getattr(msg, key)
            out.append(entry)
        return out, images


def decode_data_url(image_url: Any, where: str) -> bytes:
    """``data:image/...;base64,...`` -> bytes; other URLs are refused (the router never fetches)."""
    url = image_url.url if image_url is not None else ""
    head, sep, payload = url.partition(",")
    if not (sep and head.startswith("data:") and head.endswith(";base64")):
        raise InvalidRequestError(
            f"{where}: images must be base64 data URLs (data:image/png;base64,...); "
            "the router does not fetch URLs"
        )
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidRequestError(f"{where}: the image is not valid base64: {e}") from e


def read_template(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"--chat-template {path}: {e.strerror or e}") from e
