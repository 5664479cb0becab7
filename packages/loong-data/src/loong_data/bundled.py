"""Paths of the data files shipped inside the wheel (no download at run time)."""

from pathlib import Path

_ROOT = Path(__file__).resolve().parent

SHAKESPEARE_DIR = _ROOT / "corpus" / "shakespeare"
SHAKESPEARE_TOKENIZER = _ROOT / "tokenizers" / "shakespeare-bpe-8k" / "tokenizer.json"
CHAT_TOKENIZER_DIR = _ROOT / "tokenizers" / "shakespeare-bpe-8k-chat"
VLM_SAMPLE_DIR = _ROOT / "corpus" / "vlm_sample"
SHAKESPEARE_CHAT = _ROOT / "corpus" / "shakespeare_chat" / "qa.jsonl"
# SentencePiece (Mistral v1, 32000 pieces) as an HF tokenizer folder: the Wan text encoder's
# (built by loong_data.tools.build_spm_tokenizer)
SPM_TOKENIZER = _ROOT / "tokenizers" / "mistral-spm-32k"


def default_corpus() -> Path:
    """Folder of the bundled Shakespeare texts (42 ``*_gut.txt`` files, CC BY 2.5, see ATTRIBUTION.md)."""
    return SHAKESPEARE_DIR


def default_tokenizer() -> Path:
    """The bundled byte-level BPE ``tokenizer.json`` (8192 tokens) trained on :func:`default_corpus`."""
    return SHAKESPEARE_TOKENIZER


def default_chat_tokenizer() -> Path:
    """HF tokenizer folder: the bundled BPE + ChatML and vision special tokens + a chat template."""
    return CHAT_TOKENIZER_DIR


def default_multimodal_dataset() -> Path:
    """Folder of the bundled multimodal sample: ``conversations.jsonl`` + the images / video frames it
    references (scikit-image, scikit-learn digits, Shakespeare; see ATTRIBUTION.md)."""
    return VLM_SAMPLE_DIR


def default_chat_dataset() -> Path:
    """Text chat set for SFT: 3290 question/answer conversations about the bundled Shakespeare
    (which work has a line, which line follows), built by ``loong_data.tools.build_shakespeare_chat``."""
    return SHAKESPEARE_CHAT


ROBOT_DATASET_DIR = _ROOT / "corpus" / "metaworld_reach"


def default_robot_dataset() -> Path:
    """A LeRobot v3.0 dataset of scripted-expert Metaworld ``reach-v3`` episodes (state, 64x64
    corner camera, 4-d actions), rendered with MuJoCo by ``loong_data.tools.build_metaworld_sample``."""
    return ROBOT_DATASET_DIR
