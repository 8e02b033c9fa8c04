"""The evaluation text: reading it in any encoding, and its tokens.

:func:`read_text` decodes a file with the encoding it is given, or finds
one: a byte-order mark names it, else UTF-8, else Latin-1 as a lossless
fallback (every byte is one character, so nothing is dropped or replaced)
that the description records, so that a run on mis-decoded text says so.
:func:`text_tokens` encodes a prefix of the text as the tokenizer does by
default, and :func:`tokenization_note` says which special tokens that adds
(Gemma's tokenizer adds ``<bos>``; SmolLM2's adds nothing).
"""

from __future__ import annotations

import codecs
import hashlib
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..sources.cache import DownloadError
from ..sources.models import CORPUS_PACKAGE, corpus_path

#: The lossless fallback when a file is not UTF-8 and no encoding was given.
FALLBACK_ENCODING = "latin-1"
#: Byte-order marks, longest first (UTF-32's starts like UTF-16's).
BOMS: Tuple[Tuple[bytes, str], ...] = (
    (codecs.BOM_UTF32_LE, "utf-32"),
    (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF8, "utf-8-sig"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
)


def check_encoding(encoding: Optional[str], flag: str = "--encoding") -> Optional[str]:
    """The codec's canonical name; ``ValueError`` naming ``flag`` if Python has no such codec."""
    if encoding is None:
        return None
    try:
        return codecs.lookup(encoding).name
    except LookupError:
        raise ValueError(
            f"unknown {flag} {encoding!r}: give a Python codec name such as utf-8, latin-1, cp1252 or utf-16"
        ) from None


def decode(data: bytes, encoding: Optional[str] = None, name: str = "the text") -> Tuple[str, Dict[str, Any]]:
    """Decode ``data``; return the text and how it was decoded.

    Args:
        encoding: a Python codec name; None = byte-order mark, else UTF-8,
            else the lossless Latin-1 fallback (reported in the description).
        name: the file, for error messages.

    Returns:
        ``(text, {"encoding": codec, "encoding_source": how it was chosen,
        "encoding_note": only on the fallback})``.
    """
    if encoding is not None:
        codec = check_encoding(encoding)
        try:
            return data.decode(codec), {"encoding": codec, "encoding_source": "given"}
        except UnicodeDecodeError as e:
            raise ValueError(
                f"{name} is not valid {codec} text (byte {data[e.start]:#04x} at offset {e.start}): "
                "pass the file's encoding with --encoding"
            ) from None
    for bom, codec in BOMS:
        if data.startswith(bom):
            try:
                return data.decode(codec), {"encoding": codec, "encoding_source": "byte-order mark"}
            except UnicodeDecodeError:
                break  # a BOM-like start of some other encoding: fall through
    try:
        return data.decode("utf-8"), {"encoding": "utf-8", "encoding_source": "default"}
    except UnicodeDecodeError as e:
        note = (
            f"{name} is not UTF-8 (byte {data[e.start]:#04x} at offset {e.start}); decoded as Latin-1, "
            "one character per byte (lossless, but characters of another encoding read wrong): "
            "pass --encoding to name the right one"
        )
        return data.decode(FALLBACK_ENCODING), {
            "encoding": FALLBACK_ENCODING, "encoding_source": "fallback", "encoding_note": note,
        }


def read_text(path: Optional[str], encoding: Optional[str] = None) -> Tuple[str, Dict[str, Any]]:
    """The evaluation text and a description of it (default: gensim's lee_background.cor).

    Args:
        path: a text file; None = the default corpus.
        encoding: see :func:`decode`.
    """
    if path is None:
        try:
            p = corpus_path("lee_background")
        except DownloadError as e:
            raise DownloadError(f"{e}; or evaluate a text file of your own with --text FILE") from None
        source = f"lee_background.cor from {CORPUS_PACKAGE}"
    else:
        p = Path(path).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"text file not found: {path} (pass an existing text file to --text)")
        source = str(path)
    data = p.read_bytes()
    text, how = decode(data, encoding, str(p))
    if not text.strip():
        raise ValueError(f"{p} is empty: pass a file with some text")
    return text, {"source": source, "sha256": hashlib.sha256(data).hexdigest(), "chars": len(text), **how}


def special_tokens(tokenizer: Any, sample: str) -> Tuple[List[int], List[int]]:
    """Ids the tokenizer's default ``encode`` adds before and after ``sample``'s own tokens."""
    ids = list(tokenizer.encode(sample))
    try:
        plain = list(tokenizer.encode(sample, add_special_tokens=False))
    except TypeError:  # an encode without the flag: recognise a leading BOS at least
        bos = getattr(tokenizer, "bos_token_id", None)
        return (ids[:1] if bos is not None and ids[:1] == [bos] else []), []
    for i in range(len(ids) - len(plain) + 1):
        if ids[i : i + len(plain)] == plain:
            return ids[:i], ids[i + len(plain) :]
    return [], []  # the special tokens merge into the text's: nothing to single out


def text_tokens(tokenizer: Any, text: str, n: int) -> List[int]:
    """The first ``n`` token ids of ``text`` as ``tokenizer.encode`` gives them (no chat template).

    Special tokens the tokenizer puts before the text (a BOS) are kept, as
    generation would see them; any it puts after (an EOS) are dropped: the
    text is cut here, it does not end.
    """
    _, tail = special_tokens(tokenizer, text[:64])
    # Encode a growing prefix, not the whole corpus; tokens well before the
    # cut do not depend on it (only the last word can be split differently).
    margin = 16
    chars = max(256, n * 6)
    while True:
        whole = chars >= len(text)
        ids = list(tokenizer.encode(text[:chars]))
        if tail and ids[-len(tail) :] == tail:
            ids = ids[: -len(tail)]
        if whole or len(ids) >= n + margin:
            return ids[:n]
        chars *= 2


def tokenization_note(tokenizer: Any, text: str, windows: int) -> str:
    """How the text became tokens, as the results record it."""
    head, tail = special_tokens(tokenizer, text[:64])
    note = "tokenizer.encode(raw text), no chat template"
    if head:
        shown = _names(tokenizer, head)
        where = "the first window begins with it" if len(head) == 1 else "the first window begins with them"
        note += f"; the tokenizer adds {shown} before the text: {where}"
        note += ", later windows begin mid-text" if windows > 1 else ""
    else:
        note += "; the tokenizer adds no BOS"
    if tail:
        note += f"; the {_names(tokenizer, tail)} it adds after the text is dropped (the text is cut, not ended)"
    return note


def _names(tokenizer: Any, ids: Sequence[int]) -> str:
    try:
        tokens = tokenizer.convert_ids_to_tokens(list(ids))
    except (AttributeError, TypeError, KeyError, ValueError):  # no such method: the ids say enough
        tokens = None
    if not tokens:
        return "token ids " + ", ".join(str(i) for i in ids)
    return ", ".join(f"{t} (id {i})" for t, i in zip(tokens, ids))
