"""Build the bundled text chat set (for SFT) from the bundled Shakespeare corpus.

    python -m loong_data.tools.build_shakespeare_chat \\
        --out packages/loong-data/src/loong_data/corpus/shakespeare_chat/qa.jsonl

Two kinds of question per sampled verse line of each work: which work has this line (answer: its
title), and which line follows it (answer: the next line of the same speech). One JSON object per
line, ``{"messages": [{"role": "user", ...}, {"role": "assistant", ...}]}``. Deterministic: the
same corpus gives a byte-identical file.
"""

import argparse
import json
import random
import re
from pathlib import Path

from loong_data.bundled import default_corpus

PER_WORK = 40  # sampled lines per work; two conversations each
SMALL = {"a", "an", "and", "as", "at", "by", "for", "in", "of", "on", "or", "the", "to"}


def _title(first_line: str) -> str:
    words = first_line.strip().lower().split()
    return " ".join(w if i and w in SMALL else w.capitalize() for i, w in enumerate(words))


def _verse_pairs(lines: list[str]) -> list[tuple[str, str]]:
    """(line, next line) within one speech: both plain verse, 30-90 characters."""

    def verse(s: str) -> bool:
        return 30 <= len(s) <= 90 and not s.isupper() and not re.match(r"^\[|^\w+\.$|^(ACT|SCENE)\b", s)

    return [(a.strip(), b.strip()) for a, b in zip(lines, lines[1:]) if verse(a.strip()) and verse(b.strip())]


def conversations(corpus: Path, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for path in sorted(corpus.glob("*_gut.txt")):
        lines = path.read_text(encoding="utf-8").splitlines()
        title = _title(lines[0])
        pairs = _verse_pairs(lines[8:])
        for line, nxt in rng.sample(pairs, min(PER_WORK, len(pairs))):
            out.append({"messages": [
                {"role": "user", "content": f'Which work of Shakespeare has the line "{line}"?'},
                {"role": "assistant", "content": f"{title}."},
            ]})  # fmt: skip
            out.append({"messages": [
                {"role": "user", "content": f'In {title}, which line follows "{line}"?'},
                {"role": "assistant", "content": nxt},
            ]})  # fmt: skip
    rng.shuffle(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    rows = conversations(default_corpus())
    tmp = args.out.with_name(args.out.name + ".partial")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    tmp.replace(args.out)
    print(f"wrote {len(rows)} conversations to {args.out}")


if __name__ == "__main__":
    main()
