"""Text <-> token ids for a model directory.

`load_tokenizer(model_dir)` uses the directory's tokenizer.json (Hugging Face `tokenizers`, the file
convert copies from the checkpoint) when there is one. Otherwise it falls back to bytes: the text's
UTF-8 bytes 0..255 are token ids 0..255, and decoding drops ids outside that range (they are special
tokens such as end-of-text, with no bytes of their own) and shows invalid UTF-8 as U+FFFD. The
fallback needs a vocabulary of at least 256 ids.

`byte_level_tokenizer_json()` writes that same byte mapping as a tokenizer.json (plus <|endoftext|>
at id 256), so the demo model exercises the `tokenizers` path and both paths agree on every text.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

TOKENIZER_JSON = "tokenizer.json"
N_BYTES = 256
END_OF_TEXT = "<|endoftext|>"


class TokenizerError(ValueError):
    """The model directory has no usable tokenizer; the message says what to add."""


def check_text(text: str) -> str:
    """`text` if it is Unicode a tokenizer can encode, else ValueError naming where it is not: a lone surrogate
    (JSON's \\ud800, or bytes that are not UTF-8 on the command line, which Python keeps as \\udcXX)."""
    _utf8(text)
    return text


def _utf8(text: str) -> bytes:
    """`text` in UTF-8, or check_text's ValueError."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"the text has a lone surrogate {text[exc.start]!r} at character {exc.start} (not valid "
                         f"Unicode, or bytes that are not UTF-8); send valid UTF-8 text") from None


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class ByteTokenizer:
    """Token id b is byte b of the UTF-8 text."""

    def encode(self, text: str) -> list[int]:
        return list(_utf8(text))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < N_BYTES).decode("utf-8", errors="replace")


class HFTokenizer:
    """A tokenizer.json read by `tokenizers`; special tokens are added on encode and skipped on decode."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as _Tokenizer
        try:
            self._tok = _Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on malformed files
            raise TokenizerError(f"{path} is not a valid tokenizer.json ({exc}); replace it with the model's own "
                                 f"or delete it to use the byte-level fallback") from None

    def encode(self, text: str) -> list[int]:
        # encode_batch releases the GIL (encode does not), so a long prompt tokenized on a worker
        # thread leaves the agent's event loop free to answer other requests.
        try:
            return self._tok.encode_batch([text])[0].ids
        except TypeError:   # all it says of a lone surrogate; checked only here, so not again for a checked prompt
            check_text(text)
            raise

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


def load_tokenizer(model_dir: Path) -> Tokenizer:
    model_dir = Path(model_dir)
    if (model_dir / TOKENIZER_JSON).exists():
        return HFTokenizer(model_dir / TOKENIZER_JSON)
    vocab = _vocab_size(model_dir)
    if vocab is not None and vocab < N_BYTES:
        raise TokenizerError(f"{model_dir} has no {TOKENIZER_JSON} and its vocab_size={vocab} is below the "
                             f"{N_BYTES} ids the byte-level fallback needs; copy the model's {TOKENIZER_JSON} there")
    return ByteTokenizer()


def _vocab_size(model_dir: Path) -> int | None:
    try:
        return json.loads((model_dir / "config.json").read_text()).get("vocab_size")
    except (FileNotFoundError, ValueError, AttributeError):
        return None


def byte_level_tokenizer_json() -> str:
    """A tokenizer.json equivalent to ByteTokenizer: GPT-2's byte-to-character alphabet, no merges."""
    from tokenizers import Tokenizer as _Tokenizer
    from tokenizers import decoders, models, pre_tokenizers

    chars = _bytes_to_unicode()
    tok = _Tokenizer(models.BPE(vocab={chars[b]: b for b in range(N_BYTES)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([END_OF_TEXT])  # id 256
    return tok.to_str(pretty=True)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte, the alphabet ByteLevel pre-tokenizers use."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in keep}
    extra = 0
    for b in range(N_BYTES):
        if b not in chars:
            chars[b] = chr(N_BYTES + extra)
            extra += 1
    return chars
