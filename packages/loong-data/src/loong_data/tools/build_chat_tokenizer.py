"""Derive the bundled chat tokenizer from the bundled 8K BPE: ChatML + vision special tokens.

    python -m loong_data.tools.build_chat_tokenizer \\
        --out packages/loong-data/src/loong_data/tokenizers/shakespeare-bpe-8k-chat

The BPE vocabulary and merges are unchanged (ids 0..8191, ``<|endoftext|>`` = 0, ``<|pad|>`` = 1);
the special tokens of Qwen2.5-VL's layout are appended as ids 8192.. in :data:`CHAT_SPECIAL_TOKENS`
order, and a ChatML chat template is set. The result is an HF tokenizer folder:
``AutoTokenizer.from_pretrained(folder)`` loads it and ``apply_chat_template`` renders image and
video content items as ``<|vision_start|><|image_pad|><|vision_end|>`` (resp. ``<|video_pad|>``).
Deterministic: the same bundled tokenizer gives byte-identical files.
"""

import argparse
import shutil
from pathlib import Path

from tokenizers import AddedToken, Tokenizer

from loong_data.bundled import default_tokenizer
from loong_data.tokenizer import EOD_TOKEN, PAD_TOKEN

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
CHAT_SPECIAL_TOKENS = (IM_START, IM_END, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)

# ChatML as Qwen2-VL writes it (no default system prompt: it would cost tokens in every sample).
# The {% generation %} block marks what the assistant says (its text and the closing <|im_end|>),
# which transformers turns into an assistant mask (return_assistant_tokens_mask=True): the loss mask.
CHAT_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- else -%}{%- for item in content -%}"
    "{%- if item['type'] == 'image' or 'image' in item or 'image_url' in item -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif item['type'] == 'video' or 'video' in item -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif 'text' in item -%}{{- item['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- generation -%}{{- render(message['content']) + '<|im_end|>' -}}{%- endgeneration -%}"
    "{{- '\\n' -}}"
    "{%- else -%}{{- render(message['content']) + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def build_chat_tokenizer(base: Path, out: Path) -> None:
    """Write the chat tokenizer folder ``out`` (atomically) from the ``tokenizer.json`` ``base``."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer.from_file(str(base))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CHAT_SPECIAL_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        unk_token=None,
        bos_token=None,
        additional_special_tokens=list(CHAT_SPECIAL_TOKENS),
        model_max_length=32768,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    fast.save_pretrained(str(tmp))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loong_data.tools.build_chat_tokenizer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--base", type=Path, default=default_tokenizer(), help="tokenizer.json to extend")
    parser.add_argument("--out", type=Path, required=True, help="folder to (re)create")
    args = parser.parse_args(argv)
    build_chat_tokenizer(args.base, args.out)
    print(f"{args.out}: {sorted(p.name for p in args.out.iterdir())}, EOD {EOD_TOKEN!r} kept")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
