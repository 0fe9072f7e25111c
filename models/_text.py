"""Tokenised parallel text for the translation workload (the WMT16 en-de layout).

The layout is the one NVIDIA's GNMT example (and the seed, which used it)
prepares: one folder holding

- ``<train_prefix>.<src>`` and ``<train_prefix>.<tgt>``: one sentence per line,
  already tokenised and BPE-segmented, tokens separated by spaces, line ``n`` of
  one file the translation of line ``n`` of the other
  (``train.tok.clean.bpe.32000.en`` / ``.de``);
- the same for validation (``newstest_dev.tok.clean.bpe.32000.en`` / ``.de``);
- a vocabulary file, one token per line (``vocab.bpe.32000``).

Token ids: 0 ``<pad>``, 1 ``<unk>``, 2 ``<s>`` (begin), 3 ``</s>`` (end), then
the vocabulary file's tokens in order; the vocabulary is padded with unused
tokens to a multiple of 8 (32,320 for WMT16's 32,000 BPE merges), as the seed
did. Tokens not in the vocabulary map to ``<unk>``. A sentence becomes
``<s> tokens </s>``; pairs with either side longer than ``max_length``
(counting ``<s>`` and ``</s>``) are dropped and counted in
:attr:`ParallelText.filtered`.

Token ids are kept in two flat int32 arrays with offsets, not one tensor per
sentence, so the 4.5 million WMT16 pairs fit in a few hundred MB.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from itertools import repeat
from pathlib import Path

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import Dataset

from jabascli.errors import InputError

PAD, UNK, BOS, EOS = 0, 1, 2, 3
SPECIAL_TOKENS = ("<pad>", "<unk>", "<s>", "</s>")
# Spellings of the special tokens that a vocabulary file may already contain (NVIDIA's EOS is "<\s>").
_SPECIAL_SPELLINGS = {*SPECIAL_TOKENS, "<\\s>"}
BPE_CONTINUATION = "@@"


class Vocabulary:
    """Token <-> id, with the four special tokens first."""

    def __init__(self, tokens: Sequence[str], pad_to: int = 8) -> None:
        words = [t for t in dict.fromkeys(tokens) if t not in _SPECIAL_SPELLINGS]
        self.tokens = [*SPECIAL_TOKENS, *words]
        while len(self.tokens) % pad_to:
            self.tokens.append(f"madeupword{len(self.tokens):04d}")
        self.ids = {t: i for i, t in enumerate(self.tokens)}

    @classmethod
    def read(cls, path: Path) -> Vocabulary:
        tokens = [line.strip() for line in _lines(path)]
        tokens = [t for t in tokens if t]
        if not tokens:
            raise InputError.at(path, None, "the vocabulary file is empty; expected one token per line")
        return cls(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def encode(self, line: str) -> list[int]:
        """``<s>`` + the ids of the line's space-separated tokens + ``</s>``."""
        tokens = line.split()
        return [BOS, *map(self.ids.get, tokens, repeat(UNK, len(tokens))), EOS]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids up to ``</s>``, with BPE pieces joined."""
        words = []
        for i in ids:
            if i == EOS:
                break
            if i not in (PAD, BOS):
                words.append(self.tokens[i] if 0 <= i < len(self.tokens) else SPECIAL_TOKENS[UNK])
        return " ".join(words).replace(BPE_CONTINUATION + " ", "")


def _lines(path: Path) -> Iterator[str]:
    """The lines of a UTF-8 text file, or InputError naming the file (and the line, for bad UTF-8)."""
    path = Path(path)
    if not path.is_file():
        what = "is a folder, expected a text file" if path.is_dir() else "file not found"
        raise InputError.at(path, None, what)
    try:
        with path.open("rb") as f:
            for number, raw in enumerate(f, start=1):
                try:
                    yield raw.decode("utf-8").rstrip("\r\n")
                except UnicodeDecodeError as exc:
                    raise InputError.at(path, f"line {number}", f"not valid UTF-8 ({exc.reason})") from None
    except OSError as exc:
        raise InputError.at(path, None, f"cannot read: {exc.strerror or exc}") from None


class ParallelText(Dataset):
    """Sentence pairs of two line-aligned tokenised files, as ``(source ids, target ids)`` tensors."""

    def __init__(self, source: Path, target: Path, vocab: Vocabulary, max_length: int, min_length: int = 0) -> None:
        self.source, self.target, self.vocab = Path(source), Path(target), vocab
        self._src, self._src_at = array("i"), array("q", [0])
        self._tgt, self._tgt_at = array("i"), array("q", [0])
        self.filtered = 0
        """Pairs dropped because a side is shorter than min_length or longer than max_length tokens."""
        sources, targets = _lines(self.source), _lines(self.target)
        count = 0
        while True:
            src_line, tgt_line = next(sources, None), next(targets, None)
            if src_line is None or tgt_line is None:
                if src_line is not None or tgt_line is not None:
                    self._misaligned(count, src_line is not None, sources, targets)
                break
            count += 1
            src, tgt = vocab.encode(src_line), vocab.encode(tgt_line)
            if not (min_length <= len(src) <= max_length and min_length <= len(tgt) <= max_length):
                self.filtered += 1
                continue
            self._src.extend(src)
            self._src_at.append(len(self._src))
            self._tgt.extend(tgt)
            self._tgt_at.append(len(self._tgt))
        if count == 0:
            raise InputError.at(self.source, None, "is empty; expected one tokenised sentence per line")
        if len(self) == 0:
            raise InputError.at(
                self.source,
                None,
                f"no sentence pair is between {min_length} and {max_length} tokens long "
                f"(counting <s> and </s>); all {count} pairs were filtered out",
            )
        self._src_np = np.frombuffer(self._src, dtype=np.int32)
        self._tgt_np = np.frombuffer(self._tgt, dtype=np.int32)

    def _misaligned(self, common: int, source_longer: bool, sources: Iterator[str], targets: Iterator[str]) -> None:
        longer, shorter = (self.source, self.target) if source_longer else (self.target, self.source)
        rest = 1 + sum(1 for _ in (sources if source_longer else targets))
        raise InputError.at(
            longer,
            None,
            f"has {common + rest} lines but {shorter.name} has {common}; "
            "source and target files must be line-aligned (one sentence pair per line)",
        )

    def __len__(self) -> int:
        return len(self._src_at) - 1

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        src = self._src_np[self._src_at[index] : self._src_at[index + 1]]
        tgt = self._tgt_np[self._tgt_at[index] : self._tgt_at[index + 1]]
        return torch.from_numpy(src.astype(np.int64)), torch.from_numpy(tgt.astype(np.int64))

    def summary(self) -> str:
        return f"{len(self)} sentence pairs from {self.source.name}/{self.target.name} ({self.filtered} filtered)"


class SyntheticTranslation(Dataset):
    """A generated, learnable "translation" task: the target is the source reversed.

    Source lengths are uniform between 3 and ``max_length`` tokens (counting
    ``<s>`` and ``</s>``); sample ``i`` is regenerated from ``(seed, i)``.
    """

    def __init__(self, size: int, vocab_size: int, max_length: int, seed: int = 0) -> None:
        self.size, self.vocab_size, self.max_length, self.seed = size, vocab_size, max(3, max_length), seed
        self.filtered = 0

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.size:
            raise IndexError(index)
        g = torch.Generator().manual_seed(104_729 * (self.seed + 1) + index)
        length = int(torch.randint(1, self.max_length - 1, (), generator=g))
        words = torch.randint(len(SPECIAL_TOKENS), self.vocab_size, (length,), generator=g)
        bos, eos = torch.tensor([BOS]), torch.tensor([EOS])
        return torch.cat([bos, words, eos]), torch.cat([bos, words.flip(0), eos])

    def summary(self) -> str:
        return f"synthetic data ({self.size} sentence pairs)"


def collate_translation(
    samples: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """Pad a list of pairs into ``((source, source_lengths, decoder_input), decoder_target)``.

    Sequences are padded with ``<pad>`` to the longest in the batch (no
    bucketing: the trainer owns the sampler). The decoder reads the target
    without its last token and predicts it without its first (``<s>``); the
    padding positions of the prediction target are ignored by the loss.
    """
    sources = [s for s, _ in samples]
    targets = [t for _, t in samples]
    lengths = torch.tensor([len(s) for s in sources], dtype=torch.int64)
    src = pad_sequence(sources, batch_first=True, padding_value=PAD)
    tgt = pad_sequence(targets, batch_first=True, padding_value=PAD)
    return (src, lengths, tgt[:, :-1]), tgt[:, 1:]
