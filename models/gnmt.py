"""GNMT: an LSTM encoder-decoder with attention for translation (GNMT v2, and a tiny one).

The model follows GNMT v2 as in NVIDIA's DeepLearningExamples, the code the
seed's GNMT example was built on:

- a shared token embedding for encoder and decoder;
- encoder: a bidirectional LSTM layer, a unidirectional one that reads both
  directions, and unidirectional layers with residual connections from the
  third layer on;
- decoder: a first LSTM layer whose output queries a normalised Bahdanau
  attention over the encoder outputs; the attention context is concatenated
  to the input of every later LSTM layer (residual from the third layer on);
  a linear classifier over the vocabulary.

GNMT v2 (4 layers of 1,024, WMT16's vocabulary of 32,320 tokens) has
160,671,297 parameters; the tiny variant (2 layers of 64, 64 tokens without
data) has 215,745 and is the one CPU tests and profilers use.

Data: with ``[job] data`` set, a folder in the WMT16 en-de layout (see
``jabascli.builtin_models._text``): ``train.tok.clean.bpe.32000.{en,de}``,
``newstest_dev.tok.clean.bpe.32000.{en,de}`` for validation (optional) and
``vocab.bpe.32000``; the file names are options. Without data, a synthetic
task (translate a random sentence into its reverse). Batches are padded to
their longest sentence (no bucketing: the trainer owns the sampler, so a batch
mixes lengths); ``collate`` builds ``((source, source_lengths,
decoder_input), decoder_target)``. The loss is cross-entropy with label
smoothing 0.1 (the seed's), averaged over the target tokens of the batch, not
counting padding: a *mean per token*. As the seed, the model is trained with
Adam and a warm-up, and its gradients are clipped to a global norm of 5.0
(the seed's ``grad_clip``; ``[job] clip_grad_norm`` overrides it), which
makes the engine use ``sequential`` weight sync.

The model's ``translate(source, source_lengths)`` decodes greedily (no beam
search), for a quick look at what a trained model does.

Seed settings (``jabas_config_example_gnmt.json`` and the seed's GNMT README):
global batch size 128 to 4,096, similarity target 0.1, GPUs allocated two at
a time (``resource_alloc_unit = "2gpu"``), local batch size 64.
``examples/gnmt.toml`` holds them.

Options (``[job] options``), with their defaults for ``gnmt_v2`` / ``tiny``:

- ``vocab_size`` (32,320 / 64): the vocabulary without data; with data, the
  vocabulary file's size.
- ``dropout`` (0.2 / 0.1): dropout on the inputs of the LSTM layers.
- ``lr`` (2e-3 / 5e-3): Adam's learning rate at the initial global batch size
  (the seed's 2e-3 was for GBS 1,024).
- ``warmup_iters`` (200 / 0): linear learning-rate warm-up iterations.
- ``max_length`` (50 / 20), ``val_max_length`` (125 / 50), ``min_length``
  (0): the sentence lengths kept, in tokens counting ``<s>`` and ``</s>``.
- ``src_lang`` (en), ``tgt_lang`` (de), ``train_prefix``
  (train.tok.clean.bpe.32000), ``val_prefix``
  (newstest_dev.tok.clean.bpe.32000), ``vocab_file`` (vocab.bpe.32000): the
  data's file names.
- ``synthetic_size`` (4,500,000 / 2,048): training pairs without data.
"""

from __future__ import annotations

import math
from functools import cache
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from jabascli.builtin_models import _text
from jabascli.builtin_models._optim import warmup
from jabascli.builtin_models._options import Spec, resolve
from jabascli.errors import InputError, Problem

NAME = "gnmt"
LABEL_SMOOTHING = 0.1
CLIP_GRAD_NORM = 5.0
INIT_RANGE = 0.1

SPECS = {
    "vocab_size": Spec(int, "vocabulary size without data (with data: the vocabulary file's)", minimum=8),
    "dropout": Spec(float, "dropout on the inputs of the LSTM layers", minimum=0),
    "lr": Spec(float, "Adam learning rate", minimum=0),
    "warmup_iters": Spec(int, "linear learning-rate warm-up iterations", minimum=0),
    "max_length": Spec(int, "longest training sentence in tokens, <s> and </s> included", minimum=3),
    "val_max_length": Spec(int, "longest validation sentence in tokens", minimum=3),
    "min_length": Spec(int, "shortest sentence in tokens", minimum=0),
    "src_lang": Spec(str, "source language: the source files' suffix"),
    "tgt_lang": Spec(str, "target language: the target files' suffix"),
    "train_prefix": Spec(str, "training files: <data>/<train_prefix>.<lang>"),
    "val_prefix": Spec(str, "validation files: <data>/<val_prefix>.<lang>"),
    "vocab_file": Spec(str, "vocabulary file, one token per line, in <data>"),
    "synthetic_size": Spec(int, "training pairs when no data is given", minimum=1),
}
_WMT16 = {
    "max_length": 50,
    "val_max_length": 125,
    "min_length": 0,
    "src_lang": "en",
    "tgt_lang": "de",
    "train_prefix": "train.tok.clean.bpe.32000",
    "val_prefix": "newstest_dev.tok.clean.bpe.32000",
    "vocab_file": "vocab.bpe.32000",
}
VARIANTS: dict[str, dict[str, Any]] = {
    "gnmt_v2": {
        **_WMT16,
        "vocab_size": 32_320,
        "dropout": 0.2,
        "lr": 2e-3,
        "warmup_iters": 200,
        "synthetic_size": 4_500_000,
    },
    "tiny": {
        **_WMT16,
        "vocab_size": 64,
        "dropout": 0.1,
        "lr": 5e-3,
        "warmup_iters": 0,
        "max_length": 20,
        "val_max_length": 50,
        "synthetic_size": 2048,
    },
}
# hidden size, layers
ARCHITECTURES = {"gnmt_v2": (1024, 4), "tiny": (64, 2)}
SYNTHETIC_VAL_SIZE = {"gnmt_v2": 3000, "tiny": 256}


def settings(options: dict[str, Any]) -> Any:
    return resolve(options, SPECS, VARIANTS, "gnmt_v2")


def _lstm(input_size: int, hidden_size: int, bidirectional: bool = False) -> nn.LSTM:
    lstm = nn.LSTM(input_size, hidden_size, batch_first=True, bidirectional=bidirectional)
    for name, param in lstm.named_parameters():
        if name.startswith("bias_hh"):
            nn.init.zeros_(param)
        else:
            nn.init.uniform_(param, -INIT_RANGE, INIT_RANGE)
    return lstm


class BahdanauAttention(nn.Module):
    """Additive attention with the normalised scoring vector of GNMT (weight-normalised ``v``)."""

    def __init__(self, query_size: int, key_size: int, units: int) -> None:
        super().__init__()
        self.linear_q = nn.Linear(query_size, units, bias=False)
        self.linear_k = nn.Linear(key_size, units, bias=False)
        self.linear_att = nn.Parameter(torch.empty(units).uniform_(-INIT_RANGE, INIT_RANGE))
        self.normalize_scalar = nn.Parameter(torch.full((1,), 1.0 / math.sqrt(units)))
        self.normalize_bias = nn.Parameter(torch.zeros(units))
        nn.init.uniform_(self.linear_q.weight, -INIT_RANGE, INIT_RANGE)
        nn.init.uniform_(self.linear_k.weight, -INIT_RANGE, INIT_RANGE)

    def forward(self, query: torch.Tensor, keys: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        """The context for every query: (batch, T, key size), from keys (batch, S, key size).

        ``key_mask`` (batch, S) is True at real (not padding) source positions.
        """
        q = self.linear_q(query).unsqueeze(2)  # (batch, T, 1, units)
        k = self.linear_k(keys).unsqueeze(1)  # (batch, 1, S, units)
        v = self.linear_att / self.linear_att.norm() * self.normalize_scalar
        scores = torch.tanh(q + k + self.normalize_bias) @ v  # (batch, T, S)
        scores = scores.masked_fill(~key_mask.unsqueeze(1), torch.finfo(scores.dtype).min)
        return torch.softmax(scores, dim=-1) @ keys


class Encoder(nn.Module):
    def __init__(self, embedding: nn.Embedding, hidden: int, layers: int, dropout: float) -> None:
        super().__init__()
        self.embedding = embedding
        self.dropout = nn.Dropout(dropout)
        self.bidirectional = _lstm(hidden, hidden, bidirectional=True)
        self.layers = nn.ModuleList([_lstm(2 * hidden, hidden)] + [_lstm(hidden, hidden) for _ in range(layers - 2)])

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        x = self.dropout(self.embedding(tokens))
        packed = pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
        self.bidirectional.flatten_parameters()
        x, _ = pad_packed_sequence(self.bidirectional(packed)[0], batch_first=True, total_length=tokens.shape[1])
        for i, lstm in enumerate(self.layers):
            lstm.flatten_parameters()
            y, _ = lstm(self.dropout(x))
            x = y if i == 0 else x + y  # residual from the third layer on
        return x


class Decoder(nn.Module):
    def __init__(self, embedding: nn.Embedding, vocab_size: int, hidden: int, layers: int, dropout: float) -> None:
        super().__init__()
        self.embedding = embedding
        self.dropout = nn.Dropout(dropout)
        self.attention_lstm = _lstm(hidden, hidden)
        self.attention = BahdanauAttention(hidden, hidden, hidden)
        self.layers = nn.ModuleList([_lstm(2 * hidden, hidden) for _ in range(layers - 1)])
        self.classifier = nn.Linear(hidden, vocab_size)
        nn.init.uniform_(self.classifier.weight, -INIT_RANGE, INIT_RANGE)
        nn.init.uniform_(self.classifier.bias, -INIT_RANGE, INIT_RANGE)

    def forward(
        self,
        tokens: torch.Tensor,
        context: torch.Tensor,
        context_mask: torch.Tensor,
        state: list[Any] | None = None,
    ) -> tuple[torch.Tensor, list[Any]]:
        """Logits (batch, T, vocab) for the decoder input, and the LSTM states to continue from."""
        state = state or [None] * (1 + len(self.layers))
        self.attention_lstm.flatten_parameters()
        x, first = self.attention_lstm(self.dropout(self.embedding(tokens)), state[0])
        attended = self.attention(x, context, context_mask)
        states = [first]
        for i, lstm in enumerate(self.layers):
            lstm.flatten_parameters()
            y, h = lstm(self.dropout(torch.cat([x, attended], dim=-1)), state[i + 1])
            states.append(h)
            x = y if i == 0 else x + y  # residual from the third layer on
        return self.classifier(x), states


class GNMT(nn.Module):
    def __init__(self, vocab_size: int, hidden: int = 1024, layers: int = 4, dropout: float = 0.2) -> None:
        super().__init__()
        if layers < 2:
            raise ValueError("GNMT needs at least 2 layers")
        self.embedding = nn.Embedding(vocab_size, hidden, padding_idx=_text.PAD)
        with torch.no_grad():
            self.embedding.weight.uniform_(-INIT_RANGE, INIT_RANGE)
            self.embedding.weight[_text.PAD].zero_()
        self.encoder = Encoder(self.embedding, hidden, layers, dropout)
        self.decoder = Decoder(self.embedding, vocab_size, hidden, layers, dropout)

    def encode(self, source: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(source.shape[1], device=source.device)
        return self.encoder(source, lengths), positions < lengths.to(source.device).unsqueeze(1)

    def forward(self, source: torch.Tensor, lengths: torch.Tensor, decoder_input: torch.Tensor) -> torch.Tensor:
        """Logits (batch, target length, vocab) of the next target token at every position."""
        context, mask = self.encode(source, lengths)
        return self.decoder(decoder_input, context, mask)[0]

    @torch.no_grad()
    def translate(self, source: torch.Tensor, lengths: torch.Tensor, max_length: int = 50) -> torch.Tensor:
        """Greedy decoding: token ids (batch, up to max_length), each row ending with ``</s>`` then padding."""
        context, mask = self.encode(source, lengths)
        token = torch.full((source.shape[0], 1), _text.BOS, dtype=torch.int64, device=source.device)
        finished = torch.zeros(source.shape[0], dtype=torch.bool, device=source.device)
        state, output = None, []
        for _ in range(max_length):
            logits, state = self.decoder(token, context, mask, state)
            token = logits[:, -1].argmax(dim=-1, keepdim=True).masked_fill(finished.unsqueeze(1), _text.PAD)
            output.append(token)
            finished |= token.squeeze(1) == _text.EOS
            if bool(finished.all()):
                break
        return torch.cat(output, dim=1)


def _files(s: Any, prefix: str) -> tuple[Path, Path]:
    return s.data / f"{prefix}.{s.src_lang}", s.data / f"{prefix}.{s.tgt_lang}"


def _check_layout(s: Any) -> None:
    """Every training file is there, or an error listing each missing one and the expected layout."""
    if not s.data.exists():
        raise InputError.at(s.data, None, "data folder not found")
    if not s.data.is_dir():
        raise InputError.at(s.data, None, "is a file; expected a folder of tokenised parallel text (WMT16 layout)")
    expected = (
        f"expected <data>/{s.train_prefix}.{{{s.src_lang},{s.tgt_lang}}} and <data>/{s.vocab_file} "
        "(the options train_prefix, src_lang, tgt_lang and vocab_file name them)"
    )
    missing = [p for p in (*_files(s, s.train_prefix), s.data / s.vocab_file) if not p.is_file()]
    if missing:
        raise InputError([Problem(p, None, f"file not found; {expected}") for p in missing])


@cache
def _vocabulary(path: Path, mtime: float) -> _text.Vocabulary:
    return _text.Vocabulary.read(path)


def vocabulary(s: Any) -> _text.Vocabulary | None:
    """The data's vocabulary (read once per process), or None without data."""
    if s.data is None:
        return None
    _check_layout(s)
    path = (s.data / s.vocab_file).resolve()
    return _vocabulary(path, path.stat().st_mtime)


def vocab_size(s: Any) -> int:
    vocab = vocabulary(s)
    return s.vocab_size if vocab is None else len(vocab)


def build_model(options: dict[str, Any]) -> nn.Module:
    s = settings(options)
    hidden, layers = ARCHITECTURES[s.variant]
    return GNMT(vocab_size(s), hidden, layers, s.dropout)


def train_dataset(options: dict[str, Any]) -> torch.utils.data.Dataset:
    s = settings(options)
    vocab = vocabulary(s)
    if vocab is None:
        return _text.SyntheticTranslation(s.synthetic_size, s.vocab_size, s.max_length, seed=0)
    return _text.ParallelText(*_files(s, s.train_prefix), vocab, s.max_length, s.min_length)


def val_dataset(options: dict[str, Any]) -> torch.utils.data.Dataset | None:
    """The validation pairs; None (no validation) when the data has no validation files."""
    s = settings(options)
    vocab = vocabulary(s)
    if vocab is None:
        return _text.SyntheticTranslation(SYNTHETIC_VAL_SIZE[s.variant], s.vocab_size, s.max_length, seed=1)
    source, target = _files(s, s.val_prefix)
    if not source.is_file() and not target.is_file():
        return None
    return _text.ParallelText(source, target, vocab, s.val_max_length, s.min_length)


collate = _text.collate_translation


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Label-smoothed cross-entropy, the mean over the target tokens that are not padding."""
    return F.cross_entropy(
        output.flatten(0, 1), target.flatten(), ignore_index=_text.PAD, label_smoothing=LABEL_SMOOTHING
    )


def optimizer(params: Any, options: dict[str, Any]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=settings(options).lr)


def lr_scheduler(opt: torch.optim.Optimizer, options: dict[str, Any]) -> Any:
    return warmup(opt, settings(options).warmup_iters)


def clip_grad_norm(options: dict[str, Any]) -> float:
    """GNMT clips the whole gradient to a global L2 norm of 5.0."""
    return CLIP_GRAD_NORM


def synthetic_batch(batch_size: int, options: dict[str, Any]) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """A batch of the longest training sentences (``max_length`` tokens), the worst case for memory."""
    s = settings(options)
    size = vocab_size(s)
    length = s.max_length
    words = torch.randint(len(_text.SPECIAL_TOKENS), size, (2, batch_size, length - 2))
    bos = torch.full((batch_size, 1), _text.BOS)
    eos = torch.full((batch_size, 1), _text.EOS)
    source = torch.cat([bos, words[0], eos], dim=1)
    target = torch.cat([bos, words[1], eos], dim=1)
    lengths = torch.full((batch_size,), length, dtype=torch.int64)
    return (source, lengths, target[:, :-1]), target[:, 1:]
