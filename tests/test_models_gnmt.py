"""The gnmt workload and the tokenised parallel-text format (WMT16 layout)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from jabascli.errors import InputError
from jabascli.workload import load_workload
from tests.models_support import make_parallel_corpus, mean, train_losses

PAD, UNK, BOS, EOS = 0, 1, 2, 3


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    return make_parallel_corpus(tmp_path / "wmt16", pairs=64)


def test_parameter_counts() -> None:
    with torch.device("meta"):
        full = load_workload("gnmt", {}).build_model()
        tiny = load_workload("gnmt", {"variant": "tiny"}).build_model()
    assert sum(p.numel() for p in full.parameters()) == 160_671_297  # GNMT v2, vocabulary 32,320
    assert sum(p.numel() for p in tiny.parameters()) == 215_745


def test_corpus_is_read_in_the_wmt16_layout(corpus: Path) -> None:
    w = load_workload("gnmt", {"variant": "tiny"}, data=corpus)
    train = w.train_dataset()
    assert len(train) == 64 and train.filtered == 0
    vocab = train.vocab
    assert vocab.tokens[:4] == ["<pad>", "<unk>", "<s>", "</s>"] and len(vocab) == 32  # 4 + 24 words, padded to 8s
    english = (corpus / "train.tok.clean.bpe.32000.en").read_text().splitlines()
    src, tgt = train[0]
    assert src.dtype == torch.int64 and src[0] == BOS and src[-1] == EOS
    assert vocab.decode(src.tolist()[1:]) == english[0]
    assert len(src) == len(tgt) == len(english[0].split()) + 2
    assert "@@" not in vocab.decode(vocab.encode("die katze sa@@ auf"))  # BPE pieces are joined
    assert vocab.encode("unseen cat") == [BOS, UNK, vocab.ids["cat"], EOS]
    assert w.build_model().embedding.num_embeddings == 32
    assert w.val_dataset() is None  # no newstest_dev files in this corpus


def test_validation_files_and_length_filter(corpus: Path) -> None:
    (corpus / "dev.en").write_text("the cat\n" + " ".join(["dog"] * 30) + "\n")
    (corpus / "dev.de").write_text("die katze\n" + " ".join(["hund"] * 30) + "\n")
    w = load_workload("gnmt", {"variant": "tiny", "val_prefix": "dev", "val_max_length": 10}, data=corpus)
    val = w.val_dataset()
    assert len(val) == 1 and val.filtered == 1 and "1 filtered" in val.summary()
    short = load_workload("gnmt", {"variant": "tiny", "max_length": 6}, data=corpus).train_dataset()
    assert 0 < len(short) < 64 and len(short) + short.filtered == 64
    assert all(len(s) <= 6 and len(t) <= 6 for s, t in short)


def test_collate_pads_and_shifts_the_target() -> None:
    w = load_workload("gnmt", {"variant": "tiny"})
    a = (torch.tensor([BOS, 5, 6, EOS]), torch.tensor([BOS, 7, EOS]))
    b = (torch.tensor([BOS, 8, EOS]), torch.tensor([BOS, 9, 10, 11, EOS]))
    (src, lengths, dec_in), dec_out = w.collate([a, b])
    assert src.tolist() == [[BOS, 5, 6, EOS], [BOS, 8, EOS, PAD]]
    assert lengths.tolist() == [4, 3]
    assert dec_in.tolist() == [[BOS, 7, EOS, PAD], [BOS, 9, 10, 11]]
    assert dec_out.tolist() == [[7, EOS, PAD, PAD], [9, 10, 11, EOS]]


def test_loss_is_a_mean_per_token_ignoring_padding() -> None:
    w = load_workload("gnmt", {"variant": "tiny"})
    logits = torch.randn(2, 4, 64)
    target = torch.tensor([[7, EOS, PAD, PAD], [9, 10, 11, EOS]])
    real = target != PAD
    per_token = F.cross_entropy(logits[real], target[real], reduction="none", label_smoothing=0.1)
    assert w.loss(logits, target) == pytest.approx(float(per_token.sum() / 6), rel=1e-6)


def test_padding_does_not_change_a_sentence_translation() -> None:
    """The encoder packs its input and the attention masks padding: batch-mates do not leak in."""
    w = load_workload("gnmt", {"variant": "tiny"})
    torch.manual_seed(0)
    model = w.build_model().eval()
    short = (torch.tensor([BOS, 5, 6, EOS]), torch.tensor([BOS, 7, 8, EOS]))
    long = (torch.tensor([BOS, *range(10, 20), EOS]), torch.tensor([BOS, *range(20, 29), EOS]))
    alone = model(*w.collate([short])[0])
    batched = model(*w.collate([short, long])[0])
    assert torch.allclose(alone[0], batched[0, :3], atol=1e-5)


def test_tiny_gnmt_learns_the_corpus(corpus: Path) -> None:
    w = load_workload("gnmt", {"variant": "tiny"}, data=corpus)
    losses = train_losses(w, w.train_dataset(), batch_size=16, steps=40)
    assert mean(losses[-5:]) < 0.85 * mean(losses[:5]), losses
    model = w.build_model().eval()
    (src, lengths, _), _ = w.collate([w.train_dataset()[0]])
    out = model.translate(src, lengths, max_length=7)
    assert out.shape[0] == 1 and 1 <= out.shape[1] <= 7


def test_synthetic_data_and_worst_case_batch() -> None:
    w = load_workload("gnmt", {"variant": "tiny"})
    train = w.train_dataset()
    src, tgt = train[0]
    assert torch.equal(tgt[1:-1], src[1:-1].flip(0)) and len(src) <= 20  # the synthetic task: reverse
    (source, lengths, dec_in), dec_out = w.synthetic_batch(3)
    assert source.shape == (3, 20) and lengths.tolist() == [20, 20, 20]
    assert dec_in.shape == dec_out.shape == (3, 19)
    output = w.build_model()(source, lengths, dec_in)
    assert output.shape == (3, 19, 64) and w.loss(output, dec_out).ndim == 0
    assert len(w.val_dataset()) == 256


def test_bad_corpora_name_the_file(corpus: Path, tmp_path: Path) -> None:
    def error(data: Path, **options: object) -> list[str]:
        with pytest.raises(InputError) as info:
            load_workload("gnmt", {"variant": "tiny", **options}, data=data).train_dataset()
        return info.value.lines()

    de = corpus / "train.tok.clean.bpe.32000.de"
    lines = de.read_text().splitlines()
    de.write_text("\n".join(lines[:-3]) + "\n")
    (message,) = error(corpus)
    assert "train.tok.clean.bpe.32000.en: has 64 lines but train.tok.clean.bpe.32000.de has 61" in message

    de.write_bytes(b"die katze\n\xff\xfe broken\n")
    assert error(corpus) == [f"{de}: line 2: not valid UTF-8 (invalid start byte)"]

    empty = make_parallel_corpus(tmp_path / "empty")
    (empty / "vocab.bpe.32000").write_text("\n\n")
    assert "vocabulary file is empty" in error(empty)[0]

    missing = tmp_path / "missing"
    missing.mkdir()
    messages = error(missing)
    assert len(messages) == 3 and all("file not found" in m for m in messages)
    assert str(missing / "vocab.bpe.32000") in messages[2]
    assert "data folder not found" in error(tmp_path / "nowhere")[0]
    assert "no sentence pair" in error(make_parallel_corpus(tmp_path / "c"), max_length=3)[0]
