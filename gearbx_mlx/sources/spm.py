"""A SentencePiece-style vocabulary from GGUF metadata, as a ``tokenizers`` BPE.

A GGUF whose ``tokenizer.ggml.model`` is ``"llama"`` (Llama 2, Gemma, ...)
carries no merges: only the tokens, a score per token and a type per token.
llama.cpp tokenizes such text the SentencePiece-BPE way:

1. user-defined tokens (type 4: Gemma's ``"\\n"``, runs of spaces, HTML tags)
   are cut out of the raw text first and kept whole; control tokens (type 3)
   likewise when special tokens are parsed;
2. spaces become ``"▁"`` (and one is prepended when ``add_space_prefix``);
3. starting from single characters, the adjacent pair whose concatenation is
   a token with the highest score is merged, leftmost first, until none is;
4. a character left outside the vocabulary becomes its UTF-8 bytes
   (``<0xNN>`` tokens).

Step 3 is a BPE whose merge ranks follow the merged token's score, so the
merges are derived once from the vocabulary: every split of a normal token
into two normal tokens, ranked by the whole token's score (ties by id).
``tokenizers``' BPE with ``byte_fallback`` then does steps 3-4 exactly, and
added tokens do step 1. Gemma's scores are negated vocabulary ranks; Llama 2's
are log-probabilities: higher is merged first in both.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

#: SentencePiece's meta symbol for a space.
SPACE = "\u2581"

#: GGUF token types (llama.cpp's ``llama_token_type``).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def derive_merges(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]) -> List[Tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's highest-score-first merging.

    Only normal tokens are merged or merged into: user-defined and control
    tokens never reach the merging step (they are cut out of the text first).

    Returns:
        ``(left, right)`` pairs, highest merged score first.
    """
    normal = {t: i for i, t in enumerate(tokens) if types[i] == NORMAL}
    ranked = []
    for t, i in normal.items():
        for k in range(1, len(t)):
            left, right = t[:k], t[k:]
            if left in normal and right in normal:
                ranked.append((-float(scores[i]), i, left, right))
    ranked.sort(key=lambda m: (m[0], m[1]))
    return [(left, right) for _, _, left, right in ranked]


def spm_tokenizer(meta: Dict[str, Any]) -> Tokenizer:
    """The ``tokenizers`` object of a ``tokenizer.ggml.model == "llama"`` vocabulary.

    Raises:
        ValueError: the metadata lacks scores or types, or has no byte tokens
            for characters outside the vocabulary.
    """
    tokens = list(meta["tokenizer.ggml.tokens"])
    for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        if key not in meta or len(meta[key]) != len(tokens):
            raise ValueError(f"GGUF SentencePiece vocabulary without {key} for each of its {len(tokens)} tokens")
    scores = [float(s) for s in meta["tokenizer.ggml.scores"]]
    types = [int(t) for t in meta["tokenizer.ggml.token_type"]]
    if sum(t == BYTE for t in types) < 256:
        raise ValueError("GGUF SentencePiece vocabulary without its 256 byte tokens (<0x00>..<0xFF>)")
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    vocab = {t: i for i, t in reversed(list(enumerate(tokens)))}  # a repeated string keeps its first id
    tok = Tokenizer(models.BPE(
        vocab=vocab, merges=derive_merges(tokens, scores, types),
        unk_token=tokens[int(unk)] if unk is not None else None, fuse_unk=True, byte_fallback=True,
    ))
    decode = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if meta.get("tokenizer.ggml.add_space_prefix", True):
        # llama.cpp prepends one space to the text, not to each piece between special tokens.
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="first", split=False)
        decode.append(decoders.Strip(" ", 1, 0))
    else:
        tok.normalizer = normalizers.Replace(" ", SPACE)
    # mlx-lm streams text with its SentencePiece detokenizer when it sees this decoder.
    tok.decoder = decoders.Sequence(decode)
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, t in enumerate(types) if t == CONTROL])
    user = [AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types) if t == USER_DEFINED]
    if user:
        tok.add_tokens(user)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if bos is not None and meta.get("tokenizer.ggml.add_bos_token", False):
        b = tokens[int(bos)]
        # The tokenizer itself adds BOS, as the model's own tokenizer.json does
        # (a tokenizer_config flag alone is not read by every tokenizer class).
        tok.post_processor = processors.TemplateProcessing(
            single=f"{b} $A", pair=f"{b} $A {b} $B:1", special_tokens=[(b, int(bos))]
        )
    return tok
