"""Write the example's tokenizer (tokenizer/) and data (data.jsonl), both checked in.

The tokenizer is byte-level with no merges (256 byte tokens and <|endoftext|>): tiny, and it
reads any text, so the example runs offline. The data is the GPT example's text (a page of
Dickens and a Shakespeare sonnet), one paragraph per line. Run from anywhere:
    python examples/huggingface/make_example_files.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).parent


def make_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")
    fast.save_pretrained(folder)


def make_data(path: Path) -> None:
    sys.path.insert(0, str(HERE.parent / "gpt"))
    from data import TEXT

    paragraphs = [p.strip() for p in TEXT.split("\n\n") if p.strip()]
    path.write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs))


if __name__ == "__main__":
    make_tokenizer(HERE / "tokenizer")
    make_data(HERE / "data.jsonl")
    print(f"wrote {HERE / 'tokenizer'} and {HERE / 'data.jsonl'}")
