"""One way to put a user's prompt into a model's chat template.

Every place that prompts a chat model (the command line, calibration, the
drafter's calibration, the workload generations, scripts) goes through
:func:`apply_chat_template`, so a template that fails says so once, in one
message, and a tokenizer without a template gets the raw text (a base model:
said once, as a warning, since such a model continues the text rather than
answering it).
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Dict, List, Optional, Union

#: The notice for a tokenizer without a chat template (shown once per tokenizer).
RAW_PROMPT_NOTICE = "base model, no chat template: the prompt is used as raw text"
#: Tokenizers whose raw-prompt notice was shown (weak: a tokenizer's end forgets it).
_noticed: weakref.WeakSet[Any] = weakref.WeakSet()


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
    if system_prompt and (not use_template or not has_chat_template(tokenizer)):
        # a system prompt has a place only in a chat template (mlx-lm drops it without a word)
        warnings.warn("the system prompt is not used: "
                      + ("the chat template is off" if not use_template else "this model has no chat template")
                      + " (the prompt goes in as raw text)", UserWarning, stacklevel=2)
    if not use_template:
        return prompt
    if not has_chat_template(tokenizer):
        _notice_raw_prompt(tokenizer)
        return prompt
    try:
        return list(tokenizer.apply_chat_template(chat_messages(prompt, system_prompt), add_generation_prompt=True))
    except Exception as e:  # noqa: BLE001  (jinja errors, a template that raises on purpose)
        raise ValueError(
            f"the model's chat template failed ({type(e).__name__}: {e}); "
            "pass --ignore-chat-template to send the prompt as raw text"
        ) from None


def _notice_raw_prompt(tokenizer: Any) -> None:
    """Warn once per tokenizer that its prompts go in as raw text (calibration prompts it many times)."""
    try:
        if tokenizer in _noticed:
            return
        _noticed.add(tokenizer)
    except TypeError:  # a tokenizer that takes no weak reference: warn each time rather than never
        pass
    warnings.warn(RAW_PROMPT_NOTICE, UserWarning, stacklevel=3)


def encode_chat(tokenizer: Any, prompt: str, system_prompt: Optional[str] = None) -> List[int]:
    """Token ids of ``prompt``: templated when the tokenizer has a template, else encoded as is."""
    out = apply_chat_template(tokenizer, prompt, system_prompt)
    return list(tokenizer.encode(out)) if isinstance(out, str) else out
