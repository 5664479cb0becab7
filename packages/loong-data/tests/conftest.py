import shutil
from pathlib import Path

import pytest

from loong_data import TextTokenizer, default_corpus, default_tokenizer, load_tokenizer

# The three shortest bundled works (~25 KB): real text, fast to tokenise.
SMALL_WORKS = ("lovers_complaint_gut.txt", "passionate_pilgrim_gut.txt", "phoenix_and_the_turtle_gut.txt")


@pytest.fixture(scope="session")
def tokenizer() -> TextTokenizer:
    return load_tokenizer(default_tokenizer())


@pytest.fixture
def corpus_dir(tmp_path: Path) -> Path:
    """A folder with a private copy of three real works, which a test may edit."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    for name in SMALL_WORKS:
        shutil.copy(default_corpus() / name, folder / name)
    return folder
