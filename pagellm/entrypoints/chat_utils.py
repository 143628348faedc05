"""A conversation as the prompt text of the model's chat template, shared by ``LLM.chat`` and the server."""
from __future__ import annotations

import inspect

import jinja2


def render_chat(tok, messages: list[dict], add_generation_prompt: bool = True, chat_template: str | None = None,
                chat_template_kwargs: dict | None = None) -> str:
    """messages: [{"role", "content"}, ...] with text content. chat_template: one to use instead of the model's.
    chat_template_kwargs: the template's own variables (e.g. enable_thinking), never apply_chat_template's
    arguments. A ValueError names the field at fault."""
    if tok is None or not (chat_template or getattr(tok, "chat_template", None)):
        raise ValueError("messages: this model has no chat template")
    kwargs = chat_template_kwargs or {}
    if kwargs:
        own = set(inspect.signature(tok.apply_chat_template).parameters) - {"self", "kwargs"}
        own |= {"messages", "conversations"}  # (transformers passes the messages to the template under these too)
        if taken := sorted(own & set(kwargs)):
            raise ValueError(f"chat_template_kwargs: {', '.join(taken)} cannot be set here (the template's variables "
                             f"only)")
    try:
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                       chat_template=chat_template, **kwargs)
    except (jinja2.TemplateError, TypeError) as e:  # e.g. its own raise_exception on roles it does not take
        raise ValueError(f"messages: the model's chat template rejected them: {e}") from None
