"""A tiny char-level dataset: a few thousand characters of public-domain English, or your own.

The text is the opening of Charles Dickens' "A Tale of Two Cities" (1859) and Shakespeare's
Sonnet 18 (1609). Each character is one token. :func:`load` reads another corpus: a text file
(char-level over its characters) or token files (nanoGPT's ``.bin`` of uint16 ids, ``.npy``
arrays of ids, or a folder of either, concatenated in name order).
"""

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

TEXT = """\
It was the best of times, it was the worst of times, it was the age of wisdom, it was the age
of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season
of Light, it was the season of Darkness, it was the spring of hope, it was the winter of
despair, we had everything before us, we had nothing before us, we were all going direct to
Heaven, we were all going direct the other way--in short, the period was so far like the
present period, that some of its noisiest authorities insisted on its being received, for good
or for evil, in the superlative degree of comparison only.

There were a king with a large jaw and a queen with a plain face, on the throne of England;
there were a king with a large jaw and a queen with a fair face, on the throne of France. In
both countries it was clearer than crystal to the lords of the State preserves of loaves and
fishes, that things in general were settled for ever.

It was the year of Our Lord one thousand seven hundred and seventy-five. Spiritual revelations
were conceded to England at that favoured period, as at this. Mrs. Southcott had recently
attained her five-and-twentieth blessed birthday, of whom a prophetic private in the Life
Guards had heralded the sublime appearance by announcing that arrangements were made for the
swallowing up of London and Westminster. Even the Cock-lane ghost had been laid only a round
dozen of years, after rapping out its messages, as the spirits of this very year last past
(supernaturally deficient in originality) rapped out theirs. Mere messages in the earthly
order of events had lately come to the English Crown and People, from a congress of British
subjects in America: which, strange to relate, have proved more important to the human race
than any communications yet received through any of the chickens of the Cock-lane brood.

France, less favoured on the whole as to matters spiritual than her sister of the shield and
trident, rolled with exceeding smoothness down hill, making paper money and spending it. Under
the guidance of her Christian pastors, she entertained herself, besides, with such humane
achievements as sentencing a youth to have his hands cut off, his tongue torn out with
pincers, and his body burned alive, because he had not kneeled down in the rain to do honour
to a dirty procession of monks which passed within his view, at a distance of some fifty or
sixty yards.

Shall I compare thee to a summer's day?
Thou art more lovely and more temperate:
Rough winds do shake the darling buds of May,
And summer's lease hath all too short a date;
Sometime too hot the eye of heaven shines,
And often is his gold complexion dimm'd;
And every fair from fair sometime declines,
By chance or nature's changing course untrimm'd;
But thy eternal summer shall not fade,
Nor lose possession of that fair thou ow'st;
Nor shall death brag thou wander'st in his shade,
When in eternal lines to time thou grow'st:
So long as men can breathe or eyes can see,
So long lives this, and this gives life to thee.
"""

CHARS = sorted(set(TEXT))  # the vocabulary
vocab_size = len(CHARS)
_index = {ch: i for i, ch in enumerate(CHARS)}
tokens = torch.tensor([_index[ch] for ch in TEXT], dtype=torch.long)  # (N,)


def decode(ids: torch.Tensor) -> str:
    """Token ids back to text."""
    return "".join(CHARS[i] for i in ids.tolist())


@dataclass(frozen=True)
class Corpus:
    """Token ids, and how many distinct ids the model's vocabulary must hold. The last tenth
    is held back for evaluation: training windows never reach it."""

    tokens: torch.Tensor  # (N,) int64
    vocab_size: int

    @property
    def train(self) -> torch.Tensor:
        return self.tokens[: len(self.tokens) - len(self.tokens) // 10]

    @property
    def held_back(self) -> torch.Tensor:
        return self.tokens[len(self.tokens) - len(self.tokens) // 10 :]


TOKEN_SUFFIXES = (".bin", ".npy")


def load(path: Path) -> Corpus:
    """The corpus at ``path``: token files (``.bin``: raw uint16 ids as nanoGPT's prepare.py
    writes them; ``.npy``: an array of ids; a folder: its files of those kinds, in name order)
    or any other file as text, one token per character. ValueError naming the path when it
    holds nothing to train on."""
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in TOKEN_SUFFIXES)
        if not files:
            raise ValueError(f"data: {path} holds no token files ({', '.join(TOKEN_SUFFIXES)})")
    elif not path.is_file():
        raise ValueError(f"data: {path} not found")
    elif path.suffix in TOKEN_SUFFIXES:
        files = [path]
    else:
        text = path.read_text()
        if not text:
            raise ValueError(f"data: {path} is empty")
        chars = sorted(set(text))
        index = {ch: i for i, ch in enumerate(chars)}
        return Corpus(torch.tensor([index[ch] for ch in text], dtype=torch.long), len(chars))
    parts = [np.fromfile(f, dtype=np.uint16) if f.suffix == ".bin" else np.load(f) for f in files]
    ids = torch.from_numpy(np.concatenate(parts).astype(np.int64))
    if ids.numel() == 0 or int(ids.min()) < 0:
        raise ValueError(f"data: {path} holds no tokens, or a negative id")
    return Corpus(ids, int(ids.max()) + 1)


EMBEDDED = Corpus(tokens, vocab_size)


def batches(
    rank: int,
    world_size: int,
    batch_size: int,
    block_size: int,
    seed: int = 0,
    corpus: Corpus = EMBEDDED,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield this rank's (idx, targets) batches forever, each (batch_size, block_size), from
    the corpus (default: the embedded text) less its held-back tail.

    Step s draws batch_size * world_size windows from a generator seeded by (seed, s), and rank r
    takes the r-th slice: every rank sees different data, and a run is reproducible.
    """
    train = corpus.train
    n_windows = len(train) - block_size
    assert n_windows > 0, f"block_size {block_size} >= text length {len(train)}"
    step = 0
    while True:
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(n_windows, (batch_size * world_size,), generator=gen)
        mine = starts[rank * batch_size : (rank + 1) * batch_size]
        yield _windows(train, mine.tolist(), block_size)
        step += 1


def eval_batches(
    rank: int, world_size: int, batch_size: int, block_size: int, corpus: Corpus = EMBEDDED
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's share of the held-back tail: its non-overlapping windows, dealt to the ranks
    in turn, in batches of up to batch_size (the same count on every rank)."""
    held = corpus.held_back
    starts = list(range(0, len(held) - block_size, block_size))
    mine = starts[rank : len(starts) - len(starts) % world_size : world_size]
    for i in range(0, len(mine), batch_size):
        yield _windows(held, mine[i : i + batch_size], block_size)


def _windows(text: torch.Tensor, starts: list[int], block_size: int):
    idx = torch.stack([text[s : s + block_size] for s in starts])  # (B, T)
    targets = torch.stack([text[s + 1 : s + 1 + block_size] for s in starts])  # (B, T)
    return idx, targets
