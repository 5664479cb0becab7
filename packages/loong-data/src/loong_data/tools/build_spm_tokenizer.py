"""Build the bundled SentencePiece tokenizer folder ``tokenizers/mistral-spm-32k`` from the
SentencePiece model that ``mistral-common`` ships (``data/tokenizer.model.v1``, 32000 pieces,
Apache-2.0): transformers converts it to a fast ``tokenizer.json`` (same ids as sentencepiece),
so loading it needs only ``tokenizers``. Needs the dev dependencies mistral-common, sentencepiece.

    uv run python -m loong_data.tools.build_spm_tokenizer
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
import tempfile
from pathlib import Path

from loong_data.bundled import SPM_TOKENIZER

OUT = SPM_TOKENIZER


def build(out: Path = OUT) -> Path:
    import sentencepiece as spm
    from transformers import LlamaTokenizer

    root = importlib.util.find_spec("mistral_common").submodule_search_locations[0]
    model = Path(root) / "data" / "tokenizer.model.v1"
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(model, Path(tmp) / "tokenizer.model")
        tok = LlamaTokenizer.from_pretrained(tmp, add_bos_token=False, add_eos_token=True)
        probe = "Color image of the astronaut Eileen Collins."
        want = spm.SentencePieceProcessor(model_file=str(model)).encode(probe) + [tok.eos_token_id]
        if tok(probe).input_ids != want:
            raise RuntimeError(f"converted tokenizer disagrees with sentencepiece on {probe!r}")
        tok.pad_token = tok.unk_token  # id 0, umT5's pad id; padded positions are masked anyway
        tok.padding_side = "right"  # text first, then padding (Wan's context layout)
        out.mkdir(parents=True, exist_ok=True)
        tok.save_pretrained(out)
    from tokenizers import Tokenizer

    Tokenizer.from_file(str(out / "tokenizer.json")).save(str(out / "tokenizer.json"), pretty=False)  # 2x smaller
    (out / "SOURCE.md").write_text(
        "SentencePiece model `tokenizer.model.v1` of the PyPI package mistral-common (Apache-2.0,\n"
        "Mistral AI), converted to tokenizer.json by `python -m loong_data.tools.build_spm_tokenizer`.\n"
    )
    return out


if __name__ == "__main__":
    print(build(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT))
