"""One way to put a user's prompt into a model's chat template.

Every place that prompts a chat model (the command line, calibration, the
drafter's calibration, the workload generations, scripts) goes through
:func:`apply_chat_template`, so a template that fails says so once, in one
message, and a tokenizer without a template gets the raw text.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Union


def chat_messages(prompt: str, system_prompt: Optional[str] = None) -> List[Dict[str, str]]:
    """``[{"role": "system", ...}?, {"role": "user", "content": prompt}]``."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return messages + [{"role": "user", "content": prompt}]


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def apply_chat_template(
    tokenizer: Any, prompt: str, system_prompt: Optional[str] = None, *, use_template: bool = True
) -> Union[str, List[int]]:
    """The prompt's token ids in the tokenizer's chat template (generation prompt
    added), or ``prompt`` itself when there is no template or ``use_template``
    is False.

    Raises:
        ValueError: the template failed to render (a broken or hostile template).
    """
    if not use_template or not has_chat_template(tokenizer):
        return prompt
    try:
        return list(tokenizer.apply_chat_template(chat_messages(prompt, system_prompt), add_generation_prompt=True))
    except Exception as e:  # noqa: BLE001  (jinja errors, a template that raises on purpose)
        raise ValueError(
            f"the model's chat template failed ({type(e).__name__}: {e}); "
            "pass --ignore-chat-template to send the prompt as raw text"
        ) from None


def encode_chat(tokenizer: Any, prompt: str, system_prompt: Optional[str] = None) -> List[int]:
    """Token ids of ``prompt``: templated when the tokenizer has a template, else encoded as is."""
    out = apply_chat_template(tokenizer, prompt, system_prompt)
    return list(tokenizer.encode(out)) if isinstance(out, str) else out
