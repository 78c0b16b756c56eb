"""Shipping the summarizer: the vocabulary cut keeps the corpus' tokenization and the model's
logits on it (restricted to the kept word pieces), for both summarizer architectures (BigBird-Pegasus
and the BERT2BERT encoder-decoder)."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from data.train_default_summarize import KEEP_FIRST, shrink_vocabulary
from longdoc.testing.tiny_models import BOS, EOS, PAD, make_tiny_checkpoint, make_tiny_encoder_decoder

CORPUS = [{"document": "the water was hot and the sun was red .", "summary": "hot water"},
          {"document": "write a letter to your mother , then read the book .", "summary": "write a letter"}]


@pytest.fixture(params=["pegasus", "bert2bert"])
def shrunk(tmp_path, request):
    if request.param == "pegasus":
        src = make_tiny_checkpoint(tmp_path / "src", "summarize")
    else:
        src = make_tiny_encoder_decoder(tmp_path / "src")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in CORPUS))
    kept = shrink_vocabulary(src, tmp_path / "dst", [corpus])
    return src, tmp_path / "dst", kept


def test_shrink_keeps_corpus_tokenization_and_special_ids(shrunk):
    src, dst, kept = shrunk
    old, new = Tokenizer.from_file(str(src / "tokenizer.json")), Tokenizer.from_file(str(dst / "tokenizer.json"))
    assert len(kept) < old.get_vocab_size() and new.get_vocab_size() == len(kept)
    assert kept[:KEEP_FIRST] == list(range(min(KEEP_FIRST, old.get_vocab_size())))
    for r in CORPUS:
        for text in r.values():
            a, b = old.encode(text), new.encode(text)  # post-processor ([CLS] ... [SEP]) included
            assert a.tokens == b.tokens
            assert [kept[i] for i in b.ids] == a.ids
    assert "mountain" in old.get_vocab() and "mountain" not in new.get_vocab()  # a word the corpus lacks
    config = json.loads((dst / "config.json").read_text())
    for part in (config, config.get("encoder"), config.get("decoder")):  # an encoder-decoder's nested configs too
        if part is not None and "vocab_size" in part:
            assert part["vocab_size"] == len(kept)
    source = json.loads((src / "config.json").read_text())
    for key in ("pad_token_id", "eos_token_id", "decoder_start_token_id"):  # the same tokens, renumbered
        if source.get(key) is not None:
            assert kept[config[key]] == source[key]
    assert config["pad_token_id"] == PAD
    assert (dst / "vocab.txt").read_text().splitlines() == [new.id_to_token(i) for i in range(len(kept))]


def test_shrunk_model_gives_the_kept_logits(shrunk):
    from longdoc import model

    src, dst, kept = shrunk
    torch.manual_seed(0)
    a, b = model.load_pretrained(src), model.load_pretrained(dst)
    old, new = Tokenizer.from_file(str(src / "tokenizer.json")), Tokenizer.from_file(str(dst / "tokenizer.json"))
    text = CORPUS[1]["document"]
    ids_a = torch.tensor([old.encode(text, add_special_tokens=False).ids + [EOS]])
    ids_b = torch.tensor([new.encode(text, add_special_tokens=False).ids + [EOS]])
    dec_a = torch.tensor([[BOS] + old.encode("write a letter", add_special_tokens=False).ids])
    dec_b = torch.tensor([[BOS] + new.encode("write a letter", add_special_tokens=False).ids])
    with torch.no_grad():
        la = a(ids_a, decoder_input_ids=dec_a).logits  # (1, T, V)
        lb = b(ids_b, decoder_input_ids=dec_b).logits  # (1, T, V')
    assert lb.shape[-1] == len(kept)
    np.testing.assert_allclose(lb.numpy(), la[..., kept].numpy(), rtol=1e-5, atol=1e-5)


MODEL = Path(__file__).resolve().parents[2] / "models" / "summarize"


def summary(model, text: str, **options) -> str:
    """What the service answers for `text`: its one summarize window, greedy, the manifest's defaults."""
    from longdoc.model.tokenization import summarize_window

    m = model.manifest
    ids, _ = summarize_window(model.tokenizer.encode(text, add_special_tokens=False).ids, m.max_length,
                              m.special_tokens, m.summarize_input)
    out = model.generate(np.array([ids]), np.ones((1, len(ids)), np.int64), **options)[0]
    return model.tokenizer.decode([t for t in out if t not in m.special_tokens.values()])


def test_shipped_summarizer_is_the_long_sparse_bert2bert_and_small():
    from longdoc.export.runtime import OnnxModel

    model = OnnxModel(MODEL, threads=1)
    m = model.manifest
    assert (m.task, m.dtype, m.max_length, m.attention["pattern"]) == ("summarize", "int8", 4096, "bigbird")
    assert m.architecture == "EncoderDecoderModel" and m.summarize_input == "cls-doc-eos"
    # the shipping defaults (SHIP_GENERATION): end with [SEP] at the token limit, no repeated trigram
    assert m.decoder["generation"] == {"decoder_start_token_id": 101, "forced_eos_token_id": 102,
                                       "no_repeat_ngram_size": 3}
    # int8 MatMuls, fp16 tables: 42 M parameters, the two tables of 19,643 word pieces are most of it
    assert sum(f.stat().st_size for f in MODEL.iterdir()) < 72 * 2**20
    for name in ("LICENSE", "MODEL_CARD.md", "tokenizer.json", "TRAINING-DATA-COPYRIGHT"):
        assert (MODEL / name).is_file()


HELDOUT = json.loads((Path(__file__).parent / "heldout_pages.json").read_text())

# held-out pages of the broad corpus' test split (never trained on), a word the shipped model's
# greedy summary of each must hold (`longdoc serve` answers the same), and the summary on the
# machine that shipped it. Whole summaries are not pinned: chown's second word wins by 0.01 logits,
# which other CPUs' int8 kernels may flip; the words asserted win by 2.3 (protocol, after two steps
# won by 0.95 and 0.67), 2.5 (socket) and 4.0 (change, the first word).
ABOUT = {
    "getsockopt.2": "socket",  # "manipulate socket options"; NAME: get and set options on sockets
    "chown.2": "change",  # "change group ownership"; NAME: change ownership of a file (2,630 tokens: block-sparse)
    "ip.7": "protocol",  # "linux ip protocol protocol"; NAME: Linux IPv4 protocol implementation (8,757 tokens:
                         # past the 4096-token window)
}


def test_shipped_summarizer_reads_held_out_pages():
    from longdoc.export.runtime import OnnxModel

    model = OnnxModel(MODEL, threads=1)
    got = {name: summary(model, HELDOUT[name], max_new_tokens=32) for name in [*ABOUT, "MB_CUR_MAX.3"]}
    for name, word in ABOUT.items():
        assert word in got[name].split(), (name, got[name])
    # one answer for every page (the earlier default wrote 18 phrases for 108 pages) fails here
    assert len(set(got.values())) == len(got), got


def test_package_split_trains_on_every_page_of_the_listed_packages(tmp_path):
    """Issue 27: `--split package` trains on the page-level train and test files together (every page
    of data/packages.txt); the held-out packages' pkg-validation / pkg-test files are not read."""
    from data.train_default_summarize import package_train_file

    (tmp_path / "summarize_train.jsonl").write_text('{"id": "ls.1"}\n')
    (tmp_path / "summarize_test.jsonl").write_text('{"id": "open.2"}\n')
    (tmp_path / "summarize_pkg-test.jsonl").write_text('{"id": "tor.1"}\n')
    out = package_train_file(tmp_path)
    assert out == tmp_path / "summarize_pkg-train.jsonl"
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["ls.1", "open.2"]


def test_pack_and_unpack_rebuild_the_run_in_parts(tmp_path):
    """Weights travel back from a GPU lease as fp16 parts of bounded size: unpacking them gives the
    run's tensors (fp16-rounded) and its small files."""
    from safetensors.torch import load_file

    from data.train_default_summarize import pack, unpack

    run = make_tiny_encoder_decoder(tmp_path / "run")
    largest = max(v.numel() * 2 for v in load_file(str(run / "model.safetensors")).values())
    part_mib = largest / 3 / 2**20  # the largest tensor (fp16) travels in row blocks
    parts = pack(run, tmp_path / "parts", part_mib=part_mib)
    assert len(parts) > 3 and all(p.stat().st_size < part_mib * 2**20 + 2**14 for p in parts)
    half = len(parts) // 2  # parts travel in two calls: two folders
    (tmp_path / "second").mkdir()
    for p in parts[half:]:
        p.rename(tmp_path / "second" / p.name)
    out = unpack([tmp_path / "parts", tmp_path / "second"], tmp_path / "back")
    a, b = load_file(str(run / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert b[k].dtype == a[k].dtype
        assert torch.equal(b[k], a[k].half().to(a[k].dtype) if a[k].is_floating_point() else a[k]), k
    assert json.loads((out / "config.json").read_text()) == json.loads((run / "config.json").read_text())
    assert (out / "tokenizer.json").read_text() == (run / "tokenizer.json").read_text()


def test_validate_scores_each_run_and_decoding_beside_lead_description(tmp_path):
    """`validate` (choices on the package-disjoint validation part): one row per run, decoding and
    subset, with the batched PyTorch summaries scored as `longdoc eval` scores them."""
    from data.train_default_summarize import validate

    run = make_tiny_encoder_decoder(tmp_path / "run")
    data = tmp_path / "val.jsonl"
    pages = [{"id": f"p{i}", "document": "NAME\n x\nDESCRIPTION\n " + " ".join(["water sun red"] * (i + 1)) + ".",
              "summary": "hot water"} for i in range(5)]
    data.write_text("".join(json.dumps(r) + "\n" for r in pages))
    rows = validate([run], data, tmp_path / "v.json", batch_size=2, max_new_tokens=4)
    got = {(r["system"], r.get("decoding"), r["subset"]) for r in rows}
    assert {("run", "greedy", "all"), ("run", "beam4", "all"), ("lead-description", None, "all")} <= got
    for r in rows:
        assert r["n"] >= 1 and 0 <= r["rouge1"] <= 100 and 0 < r["distinct"] <= 1
    assert json.loads((tmp_path / "v.json").read_text())["rows"] == rows
