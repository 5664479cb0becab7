"""Conversations to token ids with a loss mask, through an HF tokenizer's chat template.

Media placeholders are expanded here: the template renders each image (video) as one
``<|image_pad|>`` (``<|video_pad|>``) between ``<|vision_start|>`` and ``<|vision_end|>``; that one
token becomes ``t*h*w / merge_size**2`` of them, the number of merged patches of the media.
"""

from collections.abc import Sequence
from pathlib import Path

import torch

from loong_data.errors import DataError
from loong_data.tokenizer import EOD_TOKEN, PAD_TOKEN
from loong_xpu.tokens import VisionTokenIds

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
ROLES = ("system", "user", "assistant")


class ConversationError(DataError):
    """A conversation that cannot be encoded (wrong structure, placeholder count mismatch)."""


class ChatTokenizer:
    """An HF tokenizer with a chat template and the vision tokens of Qwen2.5-VL's layout.

    ``encode(messages, media_tokens)`` returns the full token ids of the conversation and a 0/1
    mask of the tokens the assistant says (its text and closing ``<|im_end|>``), with every media
    placeholder expanded to its number of tokens.
    """

    def __init__(self, hf_tokenizer, path: Path | None = None) -> None:
        self.hf = hf_tokenizer
        self.path = path
        if not getattr(hf_tokenizer, "chat_template", None):
            raise ValueError(f"tokenizer {path}: no chat_template")
        ids = {}
        for token in (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD, IM_START, IM_END):
            token_id = hf_tokenizer.convert_tokens_to_ids(token)
            if token_id is None or token_id == hf_tokenizer.unk_token_id:
                raise ValueError(
                    f"tokenizer {path}: no special token {token!r} (a vision chat tokenizer needs it)"
                )
            ids[token] = int(token_id)
        self.vision = VisionTokenIds(image_token_id=ids[IMAGE_PAD], video_token_id=ids[VIDEO_PAD],
                                     vision_start_token_id=ids[VISION_START], vision_end_token_id=ids[VISION_END])  # fmt: skip
        self.im_start_id, self.im_end_id = ids[IM_START], ids[IM_END]
        self.vocab_size: int = len(hf_tokenizer)
        eod = hf_tokenizer.convert_tokens_to_ids(EOD_TOKEN)
        self.eod_id: int = int(eod) if eod is not None else self.im_end_id
        pad = hf_tokenizer.pad_token_id
        if pad is None:
            pad = hf_tokenizer.convert_tokens_to_ids(PAD_TOKEN)
        self.pad_id: int = int(pad) if pad is not None else self.eod_id
        # Templates marking assistant text with {% generation %} give the mask directly; other
        # ChatML templates (Qwen's, SmolLM2's) are masked by finding the assistant turns.
        self._generation_mask = "{% generation %}" in hf_tokenizer.chat_template.replace("-", "")
        self._assistant_header = hf_tokenizer.encode("assistant\n", add_special_tokens=False)

    def encode(
        self, messages: Sequence[dict], media_tokens: Sequence[int] = ()
    ) -> tuple[list[int], list[int]]:
        """``(ids, assistant_mask)`` of a conversation; ``media_tokens[i]`` is the token count of
        the ``i``-th image or video in order of appearance."""
        _check_messages(messages)
        if self._generation_mask:
            out = self.hf.apply_chat_template(
                list(messages), tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
        else:
            ids = list(
                self.hf.apply_chat_template(list(messages), tokenize=True, return_dict=True)["input_ids"]
            )
            mask = self._chatml_assistant_mask(ids)
        return self._expand(ids, mask, media_tokens)

    def _chatml_assistant_mask(self, ids: list[int]) -> list[int]:
        mask = [0] * len(ids)
        header = self._assistant_header
        i = 0
        while i < len(ids):
            if ids[i] == self.im_start_id and ids[i + 1 : i + 1 + len(header)] == header:
                j = i + 1 + len(header)
                while j < len(ids) and ids[j] != self.im_end_id:
                    mask[j] = 1
                    j += 1
                if j < len(ids):
                    mask[j] = 1  # the model learns to end its turn
                i = j
            i += 1
        return mask

    def _expand(
        self, ids: list[int], mask: list[int], media_tokens: Sequence[int]
    ) -> tuple[list[int], list[int]]:
        pads = (self.vision.image_token_id, self.vision.video_token_id)
        found = sum(1 for t in ids if t in pads)
        if found != len(media_tokens):
            raise ConversationError(
                f"the chat template rendered {found} media placeholders for "
                f"{len(media_tokens)} images/videos (is a placeholder token written in the text?)"
            )
        out_ids: list[int] = []
        out_mask: list[int] = []
        media = iter(media_tokens)
        for token, m in zip(ids, mask):
            if token in pads:
                n = int(next(media))
                out_ids.extend([token] * n)
                out_mask.extend([0] * n)  # media positions are inputs, never targets
            else:
                out_ids.append(token)
                out_mask.append(int(m))
        return out_ids, out_mask

    def sample(self, messages: Sequence[dict], media_tokens: Sequence[int] = ()) -> dict[str, torch.Tensor]:
        """A training sample: ``tokens`` = ids[:-1], ``labels`` = ids[1:] and ``loss_mask`` 1 where
        the label is an assistant token (float32)."""
        ids, mask = self.encode(messages, media_tokens)
        if len(ids) < 2:
            raise ConversationError("conversation renders to fewer than 2 tokens")
        x = torch.tensor(ids, dtype=torch.long)
        return {"tokens": x[:-1], "labels": x[1:], "loss_mask": torch.tensor(mask[1:], dtype=torch.float32)}

    def __repr__(self) -> str:
        return f"ChatTokenizer(path={str(self.path)!r}, vocab_size={self.vocab_size}, vision={self.vision})"


def _check_messages(messages: Sequence[dict]) -> None:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ConversationError("'messages' must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise ConversationError(f"messages[{i}]: expected an object with 'role' in {ROLES}")
        content = message.get("content")
        if isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise ConversationError(f"messages[{i}].content must be a string or a list of items")
        for j, item in enumerate(content):
            kind = item.get("type") if isinstance(item, dict) else None
            if kind not in ("text", "image", "video") or kind not in item:
                raise ConversationError(
                    f"messages[{i}].content[{j}]: expected {{'type': 'text'|'image'|'video', "
                    f"<type>: ...}}, got {item!r}"[:300]
                )


def load_chat_tokenizer(path: str | Path | None = None) -> ChatTokenizer:
    """An HF tokenizer folder with a chat template and the vision tokens (default: the bundled
    ``shakespeare-bpe-8k-chat``)."""
    from transformers import AutoTokenizer

    from loong_data.bundled import default_chat_tokenizer

    path = Path(path) if path is not None else default_chat_tokenizer()
    if not path.is_dir():
        raise FileNotFoundError(f"chat tokenizer not found: {path} (expected an HF tokenizer folder)")
    return ChatTokenizer(AutoTokenizer.from_pretrained(str(path)), path)
