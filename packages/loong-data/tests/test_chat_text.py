"""Text chat SFT samples: the loss mask covers exactly what the assistant says; errors name the line."""

import json

import pytest
import torch

from loong_data.bundled import default_chat_dataset
from loong_data.chat_text import ChatDataError, ChatTextDataset
from loong_data.multimodal import load_chat_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_chat_tokenizer()


def test_loss_only_on_assistant_tokens(tok, tmp_path):
    convo = [{"role": "system", "content": "Answer briefly."},
             {"role": "user", "content": "Which work has the line \"To be, or not to be\"?"},
             {"role": "assistant", "content": "Hamlet."},
             {"role": "user", "content": "And who says it?"},
             {"role": "assistant", "content": "Hamlet himself."}]  # fmt: skip
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"messages": convo}) + "\n")
    ds = ChatTextDataset([path], tok, 96, val_fraction=0.0)
    s = ds[0]
    assert s["tokens"].shape == s["labels"].shape == s["loss_mask"].shape == (96,)
    assert torch.equal(
        s["labels"][:-1][s["tokens"][1:] != tok.pad_id], s["tokens"][1:][s["tokens"][1:] != tok.pad_id]
    )
    targets = s["labels"][s["loss_mask"] > 0].tolist()
    assert tok.hf.decode(targets) == "Hamlet.<|im_end|>Hamlet himself.<|im_end|>"
    n = int((s["tokens"] != tok.pad_id).sum())
    assert s["loss_mask"][n:].sum() == 0  # padding is never a target


def test_bundled_set_splits_and_cuts(tok):
    train = ChatTextDataset([default_chat_dataset()], tok, 48, split="train", val_fraction=0.05)
    val = ChatTextDataset([default_chat_dataset()], tok, 48, split="val", val_fraction=0.05)
    assert 0.03 < len(val) / (len(train) + len(val)) < 0.07
    assert {tuple(x.tolist()) for x, _ in train.samples}.isdisjoint(
        {tuple(x.tolist()) for x, _ in val.samples}
    )
    assert all(len(ids) <= 49 for ids, _ in train.samples)  # cut at seq_length + 1


def test_bad_record_names_file_and_line(tok, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
                    + "\n{\"text\": \"no messages\"}\n")  # fmt: skip
    with pytest.raises(ChatDataError, match=r"bad.jsonl:2: expected a JSON object with 'messages'"):
        ChatTextDataset([path], tok, 32, val_fraction=0.0)
    path.write_text(json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n")
    with pytest.raises(ChatDataError, match=r"bad.jsonl:1: messages\[0\]"):
        ChatTextDataset([path], tok, 32, val_fraction=0.0)
