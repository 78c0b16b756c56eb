"""Training (model/train.py, model/data.py, model/warmstart.py, model/cli.py) on tiny models, CPU.

Loss falls on small synthetic tasks with block-sparse attention; checkpoints load in transformers
with the same outputs; resume continues exactly; warm start tiles positions; bad data names file:line.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from longdoc.model import data as D
from longdoc.model.train import TrainConfig, train

torch.set_num_threads(1)

WORDS = [f"w{i}" for i in range(40)]
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "</s>", "<s>"]  # ids 0..6
BIGBIRD = dict(
    model_type="big_bird", vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
    intermediate_size=64, max_position_embeddings=256, block_size=8, num_random_blocks=1,
    pad_token_id=0, bos_token_id=2, eos_token_id=3, sep_token_id=3,
    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
)  # block-sparse from (5 + 2 * 1) * 8 = 56 tokens up
PEGASUS = dict(
    model_type="bigbird_pegasus", vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2,
    encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
    max_position_embeddings=256, block_size=8, num_random_blocks=1, pad_token_id=0, eos_token_id=5,
    bos_token_id=6, decoder_start_token_id=6, dropout=0.0,
)


def write_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(directory / "tokenizer.json"))


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """Tokenizer, configs and synthetic data sets."""
    root = tmp_path_factory.mktemp("train")
    for name, config in (("bigbird", BIGBIRD), ("pegasus", PEGASUS)):
        (root / name).mkdir()
        write_tokenizer(root / name)
        (root / name / "config.json").write_text(json.dumps(config))
    rng = random.Random(0)
    # mlm: each text repeats one word, so a masked word is recoverable from its neighbours
    write_jsonl(root / "mlm.jsonl", [{"text": " ".join([rng.choice(WORDS)] * rng.randrange(60, 120))} for _ in range(48)])
    # qa: the answer is the one occurrence of "w39" in a context of other words
    qa = []
    for _ in range(48):
        words = [rng.choice(WORDS[:39]) for _ in range(rng.randrange(60, 110))]
        words[rng.randrange(len(words))] = "w39"
        context = " ".join(words)
        qa.append({"question": "w0 w1", "context": context, "answers": [{"text": "w39", "start": context.index("w39")}]})
    write_jsonl(root / "qa.jsonl", qa)
    classify = []
    for _ in range(32):
        label = rng.choice(["low", "high"])
        pool = WORDS[:20] if label == "low" else WORDS[20:]
        classify.append({"text": " ".join(rng.choice(pool) for _ in range(rng.randrange(20, 80))), "label": label})
    write_jsonl(root / "classify.jsonl", classify)
    summarize = []
    for _ in range(16):
        doc = [rng.choice(WORDS) for _ in range(rng.randrange(60, 100))]
        summarize.append({"document": " ".join(doc), "summary": " ".join(doc[:3])})
    write_jsonl(root / "summarize.jsonl", summarize)
    return root


def run(work: Path, task: str, out: str, **kw):
    model = work / ("pegasus" if task == "summarize" else "bigbird") / "config.json"
    defaults = dict(max_length=128, batch_size=8, lr=3e-3, warmup_steps=2, log_every=1000, save_every=0, quiet=True)
    defaults.update(kw)
    return train(TrainConfig(task=task, model=str(model), train=str(work / f"{task}.jsonl"), output=str(work / out), **defaults))


def mean_loss(history, part):
    return sum(h["loss"] for h in part) / len(part)


@pytest.fixture(scope="module")
def mlm_run(work):
    return run(work, "mlm", "mlm-out", max_steps=50, lr=1e-2, eval=str(work / "mlm.jsonl"), eval_every=25)


@pytest.fixture(scope="module")
def qa_run(work):
    return run(work, "qa", "qa-out", max_steps=40)


@pytest.fixture(scope="module")
def summarize_run(work):
    return run(work, "summarize", "summarize-out", max_steps=6)


# ----------------------------------------------------------------------------- loss falls


def test_mlm_loss_falls(mlm_run):
    h = mlm_run.history
    assert len(h) == 50 and mlm_run.step == 50
    first, last = mean_loss(h, h[:5]), mean_loss(h, h[-5:])
    assert first > 3.9  # ~ln(64): chance
    # below 0.7 * chance needs more than word frequencies (those give ln(40) ~ 0.89 * chance)
    assert last < 0.7 * first, (first, last)
    evals = [r["eval_loss"] for r in h if "eval_loss" in r]
    assert len(evals) == 2 and evals[1] < evals[0]


def test_qa_loss_falls(qa_run):
    h = qa_run.history
    first, last = mean_loss(h, h[:5]), mean_loss(h, h[-5:])
    assert first > 3.0  # ~ln(100 positions)
    assert last < 0.5 * first, (first, last)


def test_classify_through_the_cli_and_summarize_smoke(work, summarize_run, capsys):
    from longdoc.cli import main

    out = work / "classify-out"
    code = main(["train", "--task", "classify", "--model", str(work / "bigbird" / "config.json"),
                 "--train", str(work / "classify.jsonl"), "--eval", str(work / "classify.jsonl"),
                 "--output", str(out), "--max-length", "128", "--batch-size", "4", "--grad-accum", "2",
                 "--max-steps", "3", "--lr", "1e-3", "--log-every", "1", "--labels", "low,high"])
    assert code == 0
    err = capsys.readouterr().err
    assert "step 3/3" in err and "tok/s" in err and "eval_loss" in err and "batch 4 x 2" in err
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["BigBirdForSequenceClassification"]
    assert config["id2label"] == {"0": "low", "1": "high"}
    summary = json.loads((out / "training.json").read_text())
    assert summary["step"] == 3 and summary["labels"] == ["low", "high"]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in summary["history"])
    config = json.loads((summarize_run.output / "config.json").read_text())
    assert config["architectures"] == ["BigBirdPegasusForConditionalGeneration"]
    assert len(summarize_run.history) == 6 and all(r["loss"] > 0 for r in summarize_run.history)
    assert (summarize_run.output / "tokenizer.json").is_file()


def test_training_runs_block_sparse(work):
    """The synthetic batches are long enough for block-sparse attention (not the full fallback)."""
    from longdoc.model.lengths import plan_length

    tok, _ = __import__("longdoc.model.train", fromlist=["load_tokenizer"]).load_tokenizer(str(work / "bigbird"), None)
    special = D.special_tokens_from(tok, BIGBIRD, work / "bigbird")
    features = D.qa_features(D.read_jsonl(work / "qa.jsonl", "qa"), tok, special, 128)
    shortest = min(len(f["input_ids"]) for f in features)
    assert plan_length(shortest, 8, 1, "block_sparse").attention == "block_sparse"


# ----------------------------------------------------------------------------- transformers loads it


def _compare_with_transformers(directory: Path, ours_cls_name: str, inputs: dict, fields: tuple[str, ...]):
    import transformers

    from longdoc.model import load_pretrained

    ours = load_pretrained(directory, plan="hf-eval")  # transformers in eval mode
    theirs = getattr(transformers, ours_cls_name).from_pretrained(directory).eval()
    with torch.no_grad():
        a, b = ours(**inputs), theirs(**inputs)
    for name in fields:
        diff = (getattr(a, name) - getattr(b, name)).abs().max().item()
        assert diff <= 1e-5, (name, diff)


def test_saved_checkpoints_load_in_transformers(mlm_run, qa_run, summarize_run):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(7, 47, (2, 100), generator=g)  # 100 > 56: block-sparse
    ids[:, 0], ids[:, 5], ids[:, -1] = 2, 3, 3  # [CLS] q q q q [SEP] ... [SEP]
    mask = torch.ones_like(ids)
    mask[1, 80:] = 0
    _compare_with_transformers(qa_run.output, "BigBirdForQuestionAnswering",
                               {"input_ids": ids, "attention_mask": mask}, ("start_logits", "end_logits"))
    _compare_with_transformers(mlm_run.output, "BigBirdForMaskedLM", {"input_ids": ids, "attention_mask": mask}, ("logits",))
    _compare_with_transformers(summarize_run.output, "BigBirdPegasusForConditionalGeneration",
                               {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": ids[:, :7]}, ("logits",))


def test_output_names_the_special_tokens_training_used(qa_run, summarize_run):
    """The serving path (longdoc.model.tokenization) resolves the ids the data was built with."""
    from longdoc.model.tokenization import special_token_ids

    ids = special_token_ids(qa_run.output)
    assert (ids["cls"], ids["sep"], ids["pad"], ids["mask"]) == (2, 3, 0, 4)
    ids = special_token_ids(summarize_run.output)
    assert (ids["eos"], ids["pad"], ids["decoder_start"]) == (5, 0, 6)


def test_fine_tune_from_checkpoint_adds_head(work, mlm_run, capsys):
    """QA fine-tuning from the MLM checkpoint: the encoder is loaded, the QA head is new, the MLM
    head is dropped (both said), and the encoder weights are the MLM run's at step 0."""
    from longdoc.model import load_pretrained

    result = train(TrainConfig(task="qa", model=str(mlm_run.output), train=str(work / "qa.jsonl"),
                               output=str(work / "qa-from-mlm"), max_length=128, max_steps=1, lr=0.0, warmup_steps=0))
    err = capsys.readouterr().err
    assert "initialised fresh" in err and "qa_classifier" in err and "not used" in err and "cls.predictions" in err
    mlm = load_pretrained(mlm_run.output).state_dict()
    qa = load_pretrained(result.output).state_dict()
    key = "bert.encoder.layer.1.attention.self.query.weight"
    assert torch.equal(mlm[key], qa[key])  # lr 0: unchanged


def test_fine_tune_refuses_an_encoder_that_does_not_fit(work, mlm_run, tmp_path):
    """Only task heads may be fresh or dropped: a wrong encoder shape or a stray key is an error
    naming the key, even under the fine-tuning policy."""
    from safetensors.torch import load_file, save_file

    from longdoc.model.checkpoint import LoadError
    from longdoc.model.train import build_model, load_weights

    bad = tmp_path / "bad"
    bad.mkdir()
    for f in mlm_run.output.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            (bad / f.name).write_bytes(f.read_bytes())
    state = load_file(str(mlm_run.output / "model.safetensors"))
    key = "bert.encoder.layer.0.output.dense.weight"
    state[key] = state[key][:, :-1].contiguous()
    state["bert.encoder.extra.weight"] = torch.zeros(2)
    save_file(state, str(bad / "model.safetensors"))
    config = json.loads((mlm_run.output / "config.json").read_text())
    module = build_model("qa", config, plan="hf-train")
    with pytest.raises(LoadError) as info:
        load_weights(module, "qa", bad, log=lambda *_: None)
    assert key in str(info.value) and "bert.encoder.extra.weight" in str(info.value)


# ----------------------------------------------------------------------------- resume


def test_resume_continues_step_schedule_and_data(work):
    kw = dict(max_steps=6, save_every=3, keep_checkpoints=5, dropout=0.1, lr=1e-3, warmup_steps=2)
    full = run(work, "mlm", "resume-full", **kw)
    out = work / "resume-cut"
    run(work, "mlm", "resume-cut", **kw)
    # simulate a run killed after step 3: only checkpoint-3 survives
    import shutil

    for p in [out / "checkpoint-6", out / "model.safetensors", out / "training.json"]:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    state = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["step"] == 3 and len(state["history"]) == 3
    resumed = run(work, "mlm", "resume-cut", resume=True, **kw)
    assert resumed.step == 6
    assert [r["step"] for r in resumed.history] == [1, 2, 3, 4, 5, 6]
    # same learning rates (schedule continued, not restarted) and the same losses (same data, masks, dropout)
    assert [r["lr"] for r in resumed.history] == [r["lr"] for r in full.history]
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in full.history]
    from safetensors.torch import load_file

    a, b = load_file(str(full.output / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_linear_schedule():
    from longdoc.model.train import linear_schedule

    f = linear_schedule(warmup=4, total=10)
    values = [f(s) for s in range(11)]
    assert values[:4] == [0.2, 0.4, 0.6, 0.8] and values[4] == 1.0
    assert values[7] == pytest.approx(0.5) and values[10] == 0.0
    assert all(a >= b for a, b in zip(values[4:], values[5:]))


# ----------------------------------------------------------------------------- data


def test_qa_windows_hold_the_answer(work):
    from longdoc.model.train import load_tokenizer

    tok, _ = load_tokenizer(str(work / "bigbird"), None)
    special = D.special_tokens_from(tok, BIGBIRD)
    context = " ".join(WORDS[i % 30] for i in range(200)) + " w39 w38 " + " ".join(["w1"] * 50)
    records = [D.Record("x:1", {"question": "w2", "context": context,
                                "answers": [{"text": "w39 w38", "start": context.index("w39")}]})]
    windows = D.qa_features(records, tok, special, 64, doc_stride=40)
    assert len(windows) > 3
    holding = [f for f in windows if f["start_positions"]]
    assert holding  # some window holds the answer, the others point at [CLS]
    for f in windows:
        assert len(f["input_ids"]) <= 64 and f["input_ids"][:3] == [2, tok.token_to_id("w2"), 3]
        assert f["input_ids"][-1] == 3 and len(f["token_type_ids"]) == len(f["input_ids"])
        if f["start_positions"]:
            span = f["input_ids"][f["start_positions"] : f["end_positions"] + 1]
            assert tok.decode(span) == "w39 w38"
    positives = D.qa_features(records, tok, special, 64, doc_stride=40, negative_windows=0.0)
    assert positives == holding
    truncated = D.qa_features(records, tok, special, 64, long_context="truncate")
    assert len(truncated) == 1 and truncated[0]["start_positions"] == 0  # answer beyond the first window


def test_masking_is_bert_80_10_10():
    special = D.SpecialTokens(pad=0, cls=2, sep=3, mask=4, vocab_size=64)
    ids = torch.randint(7, 47, (64, 512))
    ids[:, 0], ids[:, -1], ids[:, -20:-1] = 2, 3, 0
    masked, labels = D.mask_tokens(ids, special, torch.Generator().manual_seed(0))
    chosen = labels != D.IGNORE_INDEX
    maskable = (ids != 0) & (ids != 2) & (ids != 3)
    assert not (chosen & ~maskable).any()  # specials and padding never chosen
    assert torch.equal(labels[chosen], ids[chosen])
    assert 0.14 < chosen.sum() / maskable.sum() < 0.16
    n = chosen.sum()
    as_mask = (masked[chosen] == 4).sum() / n
    unchanged = (masked[chosen] == ids[chosen]).sum() / n
    assert 0.77 < as_mask < 0.83 and 0.08 < unchanged < 0.13
    assert torch.equal(masked[~chosen], ids[~chosen])


def test_summarize_labels_shifted_for_teacher_forcing():
    special = D.SpecialTokens(pad=0, eos=5, decoder_start=6)
    batch = D.collate_summarize([{"input_ids": [9, 10, 5], "labels": [11, 12, 5]}, {"input_ids": [9, 5], "labels": [13, 5]}], special)
    assert batch["labels"].tolist() == [[11, 12, 5], [13, 5, -100]]
    assert batch["decoder_input_ids"].tolist() == [[6, 11, 12], [6, 13, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"question": "q", "context": "abc"', "not valid JSON"),
        ('{"question": "q", "context": "abc"}', "missing field(s) 'answers'"),
        ('{"question": "q", "context": "abc", "answers": [{"text": "x", "start": 0}]}', "is not at character 0"),
        ('["not", "an", "object"]', "expected a JSON object"),
    ],
)
def test_bad_jsonl_names_file_and_line(tmp_path, line, message):
    good = '{"question": "q", "context": "abc", "answers": [{"text": "b", "start": 1}]}'
    path = tmp_path / "bad.jsonl"
    path.write_text(f"{good}\n\n{line}\n")
    with pytest.raises(D.DataError) as info:
        D.read_jsonl(path, "qa")
    assert f"{path}:3:" in str(info.value) and message in str(info.value)


def test_bad_jsonl_through_the_cli(work, tmp_path, capsys):
    from longdoc.cli import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "w1 w2", "label": "a"}\n{"text": "w3"}\n')
    code = main(["train", "--task", "classify", "--model", str(work / "bigbird" / "config.json"),
                 "--train", str(bad), "--output", str(tmp_path / "out")])
    assert code == 1
    assert f"{bad}:2: missing field(s) 'label'" in capsys.readouterr().err


# ----------------------------------------------------------------------------- warm start


def _tiny_encoder(kind: str, directory: Path, positions: int):
    import transformers

    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                  max_position_embeddings=positions, hidden_act="gelu", hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    if kind == "bert":
        model = transformers.BertModel(transformers.BertConfig(**common))
    else:
        model = transformers.RobertaForMaskedLM(transformers.RobertaConfig(**common, pad_token_id=1))
    model.save_pretrained(directory)
    write_tokenizer(directory)
    return model.eval()


def test_warmstart_bert_tiles_positions_and_keeps_outputs(tmp_path):
    import transformers

    from longdoc.model import load_pretrained
    from longdoc.model.warmstart import warm_start

    bert = _tiny_encoder("bert", tmp_path / "bert", 16)
    record = warm_start(tmp_path / "bert", tmp_path / "bb", 64, block_size=8, num_random_blocks=1)
    assert record["source_positions"] == 16 and record["dropped_keys"] == []
    old = bert.embeddings.position_embeddings.weight
    ours = load_pretrained(tmp_path / "bb")
    new = ours.embeddings.position_embeddings.weight
    assert new.shape == (64, 32)
    for i in range(64):
        assert torch.equal(new[i], old[i % 16])
    assert torch.equal(new[3], new[3 + 16]) and torch.equal(new[3], new[3 + 48])
    config = json.loads((tmp_path / "bb" / "config.json").read_text())
    assert config["model_type"] == "big_bird" and config["max_position_embeddings"] == 64
    assert config["sep_token_id"] == 3 and config["hidden_act"] == "gelu"
    tok = json.loads((tmp_path / "bb" / "tokenizer.json").read_text())
    assert tok["truncation"] is None and tok["padding"] is None
    # same encoder: on a short input (full attention) BigBird = the BERT it came from
    ids = torch.randint(7, 47, (2, 12))
    with torch.no_grad():
        ref = bert(ids)
        theirs = transformers.BigBirdModel.from_pretrained(tmp_path / "bb").eval()(ids)
        mine = ours(ids)
    assert (ref.last_hidden_state - theirs.last_hidden_state).abs().max() < 1e-5
    assert (ref.last_hidden_state - mine.last_hidden_state).abs().max() < 1e-5
    assert (ref.pooler_output - mine.pooler_output).abs().max() < 1e-5


def test_warmstart_roberta_skips_its_offset_rows(tmp_path):
    from longdoc.model import load_pretrained
    from longdoc.model.warmstart import warm_start

    roberta = _tiny_encoder("roberta", tmp_path / "rob", 18)  # 16 usable positions + 2 offset rows
    warm_start(tmp_path / "rob", tmp_path / "bb", 64, block_size=8, num_random_blocks=1)
    ours = load_pretrained(tmp_path / "bb")
    assert type(ours).__name__ == "BigBirdForMaskedLM"
    old = roberta.roberta.embeddings.position_embeddings.weight[2:]
    new = ours.bert.embeddings.position_embeddings.weight
    assert all(torch.equal(new[i], old[i % 16]) for i in range(64))
    assert torch.equal(ours.cls.predictions.transform.dense.weight, roberta.lm_head.dense.weight)


def test_warmstart_cli_and_unknown_type(tmp_path, capsys):
    from longdoc.cli import main

    _tiny_encoder("bert", tmp_path / "bert", 16)
    assert main(["warmstart", str(tmp_path / "bert"), str(tmp_path / "bb"), "--max-length", "64", "--block-size", "8"]) == 0
    assert "positions 16 -> 64" in capsys.readouterr().out
    config = json.loads((tmp_path / "bert" / "config.json").read_text())
    config["model_type"] = "gpt2"
    (tmp_path / "bert" / "config.json").write_text(json.dumps(config))
    assert main(["warmstart", str(tmp_path / "bert"), str(tmp_path / "bb2")]) == 1
    assert "model_type 'gpt2'" in capsys.readouterr().err


def test_clear_errors_for_wrong_model_or_precision(work):
    with pytest.raises(ValueError, match="task 'summarize' needs a 'bigbird_pegasus' or 'encoder-decoder' model"):
        train(TrainConfig(task="summarize", model=str(work / "bigbird" / "config.json"),
                          train=str(work / "summarize.jsonl"), output=str(work / "x")))
    with pytest.raises(ValueError, match="fp16 needs a CUDA device"):
        run(work, "mlm", "x", max_steps=1, precision="fp16", device="cpu")


def test_bf16_autocast_trains_on_cpu(work):
    """--precision bf16 runs CPU autocast (the default summarizer's recipe where the CPU has bf16
    dot products): the first step's loss is the fp32 loss up to bf16 rounding, not equal to it
    (so the step really ran in bf16), and the saved weights stay fp32."""
    from safetensors.torch import load_file

    fp32 = run(work, "summarize", "p-fp32", max_steps=1, precision="fp32", device="cpu")
    bf16 = run(work, "summarize", "p-bf16", max_steps=1, precision="bf16", device="cpu")
    a, b = fp32.history[0]["loss"], bf16.history[0]["loss"]
    assert a != b and abs(a - b) < 0.02 * a, (a, b)
    weights = load_file(str(Path(bf16.output) / "model.safetensors"))
    assert {t.dtype for t in weights.values()} == {torch.float32}


def test_summarize_features_are_the_served_input():
    """Training feeds a summarizer the encoder input its export serves (the one summarize_window):
    `document eos` for Pegasus, `[CLS] document [SEP]` for BERT2BERT, cut to max_length."""
    from longdoc.model.tokenization import summarize_input_of
    from longdoc.testing.tiny_models import tiny_tokenizer

    tok = tiny_tokenizer()
    special = D.SpecialTokens(pad=0, cls=101, sep=102, eos=102, decoder_start=101)
    records = [D.Record("x:1", {"document": "the boy saw a fish in the sea", "summary": "a fish"})]
    doc = tok.encode("the boy saw a fish in the sea", add_special_tokens=False).ids
    pegasus = D.summarize_features(records, tok, special, 6, 8, summarize_input_of("bigbird_pegasus"))
    assert pegasus[0]["input_ids"] == [*doc[:5], 102]
    b2b = D.summarize_features(records, tok, special, 6, 8, summarize_input_of("encoder-decoder"))
    assert b2b[0]["input_ids"] == [101, *doc[:4], 102] and b2b[0]["labels"][-1] == 102


def test_training_reads_the_tokenizer_with_the_one_loader(tmp_path):
    """A checkpoint as downloaded may ship vocab.txt (or spiece.model, vocab.json + merges.txt)
    without tokenizer.json: `longdoc train` says which files it found and how to convert them, as
    export does, instead of only "no tokenizer"."""
    from longdoc.model.train import load_tokenizer

    (tmp_path / "vocab.txt").write_text("[PAD]\n[UNK]\nhello\n")
    with pytest.raises(ValueError, match=r"found vocab\.txt.*--tokenizer DIR_OR_FILE"):
        load_tokenizer(str(tmp_path), None)
