"""A thin text tokenizer over HF ``tokenizers``: encode/decode plus the ids training needs."""

import json
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer

from loong_data.log import logger

EOD_TOKEN = "<|endoftext|>"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
PAD_TOKEN = "<|pad|>"
TOKENIZER_FILE = "tokenizer.json"


class TextTokenizer:
    """A loaded ``tokenizer.json`` with the end-of-document and padding ids.

    ``encode`` never adds special tokens (no BOS from HF post-processors): documents are
    delimited by appending :attr:`eod_id` explicitly when a corpus is tokenised.
    """

    def __init__(self, tokenizer: Tokenizer, path: Path, eod_id: int, pad_id: int) -> None:
        self._tokenizer = tokenizer
        self.path = path
        self.eod_id = eod_id
        self.pad_id = pad_id
        # Added tokens count: an id must index into the embedding table.
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without special tokens."""
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; special tokens are kept so that decode(encode(x)) == x holds for EOD too."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"TextTokenizer(path={str(self.path)!r}, vocab_size={self.vocab_size}, eod_id={self.eod_id})"


def _configured_pad(folder: Path) -> str | None:
    """The pad token an HF tokenizer folder declares (``tokenizer_config.json``), if any."""
    try:
        pad = json.loads((folder / TOKENIZER_CONFIG_FILE).read_text(encoding="utf-8")).get("pad_token")
    except (OSError, ValueError, AttributeError):
        return None
    return pad.get("content") if isinstance(pad, dict) else pad if isinstance(pad, str) else None


def load_tokenizer(path: str | Path, *, eod_token: str = EOD_TOKEN, pad_token: str | None = None) -> TextTokenizer:
    """Load a ``tokenizer.json``, or a folder holding one (an HF model folder).

    ``eod_token`` must be in the vocabulary. ``pad_token`` (default: the one the folder's
    ``tokenizer_config.json`` declares, else ``<|pad|>``) may be missing (HF model tokenizers often
    have none); the EOD id is used for padding then, which is harmless because padded positions
    are masked out of the loss.
    """
    path = Path(path)
    file = path / TOKENIZER_FILE if path.is_dir() else path
    if not file.is_file():
        expected = f"a {TOKENIZER_FILE} file or a folder containing one"
        raise FileNotFoundError(f"tokenizer not found: {file} (expected {expected})")
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
        raise ValueError(f"cannot load tokenizer {file}: {e}") from e
    eod_id = tokenizer.token_to_id(eod_token)
    if eod_id is None:
        raise ValueError(
            f"tokenizer {file} has no end-of-document token {eod_token!r}; "
            "pass eod_token= with the token this tokenizer uses to end a document"
        )
    pad_token = pad_token or _configured_pad(file.parent) or PAD_TOKEN
    pad_id = tokenizer.token_to_id(pad_token)
    if pad_id is None:
        logger.debug("tokenizer %s has no %r; padding with the EOD id %d", file, pad_token, eod_id)
        pad_id = eod_id
    return TextTokenizer(tokenizer, file, eod_id=eod_id, pad_id=pad_id)
