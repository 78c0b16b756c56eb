"""Tiny BigBird (and Longformer: `make_tiny_longformer`, LED: `make_tiny_led`, ModernBERT:
`make_tiny_modernbert`) checkpoints and exported model directories for tests, benchmarks and the
docs' examples (seconds to build).

    make_tiny_checkpoint(directory, task)   HF-format checkpoint dir: config.json,
                                            model.safetensors, tokenizer.json
                                            [, generation_config.json: `generation=`]
    make_tiny_export(directory, task, dtype="fp32")   `longdoc export` of it (a model dir)

Shapes: hidden 32, 2 heads, 2 layers, block_size 16, 2 random blocks, max_position 512 (several
windows; full attention up to (5 + 2*2) * 16 = 144 tokens, block-sparse above). The tokenizer is
a WordLevel vocabulary over TINY_WORDS plus specials, so real English text tokenizes with offsets
(words outside the list become [UNK]).
"""

from __future__ import annotations

import json
from pathlib import Path

TASKS = ("qa", "classify", "mlm", "summarize")
SPECIALS = ["[PAD]", "</s>", "<s>", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
PAD, EOS, BOS, UNK, CLS, SEP, MASK = range(len(SPECIALS))
CLASSIFY_LABELS = ["negative", "neutral", "positive"]
# generation options the plain tiny summarizer leaves unset (transformers' defaults), for a
# summarizer that sets every one the search handles: eos is forbidden for the first 5 generated
# tokens and forced at the last position; no bigram repeats; beams prefer longer hypotheses
TINY_GENERATION = dict(min_length=6, forced_eos_token_id=EOS, no_repeat_ngram_size=2, length_penalty=0.6)

TINY_WORDS = """
the of and to a in is it you that he was for on are with as i his they be at one have this from
or had by hot word but what some we can out other were all there when up use your how said an
each she which do their time if will way about many then them write would like so these her long
make thing see him two has look more day could go come did number sound no most people my over
know water than call first who may down side been now find any new work part take get place made
live where after back little only round man year came show every good me give our under name very
through just form sentence great think say help low line differ turn cause much mean before move
right boy old too same tell does set three want air well also play small end put home read hand
port large spell add even land here must big high such follow act why ask men change went light
kind off need house picture try us again animal point mother world near build self earth father
head stand own page should country found answer school grow study still learn plant cover food
sun four between state keep eye never last let thought city tree cross farm hard start might story
saw far sea draw left late run while press close night real life few north open seem together next
white children begin got walk example ease paper group always music those both mark often letter
until mile river car feet care second book carry took science eat room friend began idea fish
mountain stop once base hear horse cut sure watch color face wood main enough plain girl usual
young ready above ever red list though feel talk bird soon body dog family direct pose leave song
measure door product black short numeral class wind question happen complete ship area half rock
order fire south problem piece told knew pass since top whole king space heard best hour better
true during hundred five remember step early hold west ground interest reach fast verb sing listen
six table travel less morning ten simple several vowel toward war lay against pattern slow center
love person money serve appear road map rain rule govern pull cold notice voice unit power town
fine certain fly fall lead cry dark machine note wait plan figure star box noun field rest correct
able pound done beauty drive stood contain front teach week final gave green oh quick develop
ocean warm free minute strong special mind behind clear tail produce fact street inch multiply
nothing course stay wheel full force blue object decide surface deep moon island foot system busy
test record boat common gold possible plane stead dry wonder laugh thousand ago ran check game
shape equate miss brought heat snow tire bring yes distant fill east paint language among . , ? !
""".split()



def nudge_vectors(model, std: float) -> None:
    """Move every 1-d parameter (norm weights and biases) off its init by N(0, std): a randomly
    initialised model has ones and zeros there, under which a norm or bias mix-up would not show."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * std)


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for word in TINY_WORDS:
        vocab.setdefault(word, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", CLS), ("[SEP]", SEP)])
    tok.add_special_tokens(SPECIALS)
    return tok


def vocab_size() -> int:
    return len(tiny_tokenizer().get_vocab())


def default_dropout(config_class) -> dict:
    """The dropout probabilities and layerdrop of a transformers config class's defaults (BigBird,
    Longformer, BERT: 0.1 hidden and attention dropout; Pegasus, LED: dropout 0.1), what the public
    checkpoints hold: overrides for the tiny checkpoints, which otherwise switch dropout off."""
    return {k: v for k, v in config_class().to_dict().items()
            if ("dropout" in k or "layerdrop" in k) and isinstance(v, float)}


def tiny_config(task: str) -> dict:
    """transformers config kwargs of the tiny model for a task."""
    common = dict(vocab_size=vocab_size(), max_position_embeddings=512, block_size=16, num_random_blocks=2,
                  attention_type="block_sparse", pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)
    if task == "summarize":
        return dict(common, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                    decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                    decoder_start_token_id=BOS, forced_eos_token_id=None, dropout=0.0, attention_dropout=0.0,
                    init_std=0.25)
    extra = {}
    if task == "classify":
        extra = dict(num_labels=3, id2label=dict(enumerate(CLASSIFY_LABELS)),
                     label2id={v: k for k, v in enumerate(CLASSIFY_LABELS)})
    return dict(common, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                sep_token_id=SEP, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                initializer_range=0.25, **extra)


def make_tiny_checkpoint(directory, task: str, seed: int = 0, source: str = "model", generation: dict | None = None,
                         **overrides) -> Path:
    """A random-init checkpoint for `task` saved in the Hugging Face format. source="model":
    built with our model/ and written by `longdoc.model.save_pretrained`; source="transformers": built
    and saved by transformers (a "converted" checkpoint). `overrides` change config fields;
    `generation` adds generation settings to generation_config.json, where transformers keeps
    them (it drops them from config.json)."""
    import torch

    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    kwargs = dict(tiny_config(task), **overrides)
    if source == "model":
        return _write_generation_config(_make_with_model(directory, task, seed, kwargs), generation)
    if source != "transformers":
        raise ValueError("source must be 'model' or 'transformers'")
    import transformers

    cls, config_cls = {
        "qa": (transformers.BigBirdForQuestionAnswering, transformers.BigBirdConfig),
        "classify": (transformers.BigBirdForSequenceClassification, transformers.BigBirdConfig),
        "mlm": (transformers.BigBirdForMaskedLM, transformers.BigBirdConfig),
        "summarize": (transformers.BigBirdPegasusForConditionalGeneration, transformers.BigBirdPegasusConfig),
    }[task]
    torch.manual_seed(seed)
    model = cls(config_cls(**kwargs)).eval()
    if task == "summarize":  # random-init final_logits_bias is zero; make it count, and eos likely
        with torch.no_grad():
            model.final_logits_bias.normal_(0, 0.5)
            model.final_logits_bias[0, EOS] += 2.0
    model.save_pretrained(directory, safe_serialization=True)
    tiny_tokenizer().save(str(directory / "tokenizer.json"))
    return _write_generation_config(directory, generation)


def _write_generation_config(directory: Path, generation: dict | None) -> Path:
    if generation:
        path = directory / "generation_config.json"
        config = json.loads(path.read_text()) if path.is_file() else {}
        config.pop("_from_model_config", None)  # edited by hand, as a model author would
        path.write_text(json.dumps({**config, **generation}, indent=2) + "\n")
    return directory


def _make_with_model(directory: Path, task: str, seed: int, kwargs: dict) -> Path:
    import torch

    from longdoc import model
    from longdoc.model import bigbird, pegasus

    torch.manual_seed(seed)
    if task == "summarize":
        module = pegasus.BigBirdPegasusForConditionalGeneration(pegasus.BigBirdPegasusConfig.from_dict(kwargs))
        with torch.no_grad():
            module.final_logits_bias.normal_(0, 0.5)
            module.final_logits_bias[0, EOS] += 2.0
    else:
        cls = {"qa": bigbird.BigBirdForQuestionAnswering, "classify": bigbird.BigBirdForSequenceClassification,
               "mlm": bigbird.BigBirdForMaskedLM}[task]
        module = cls(bigbird.BigBirdConfig.from_dict(kwargs))
    model.save_pretrained(module.eval(), directory)
    tiny_tokenizer().save(str(directory / "tokenizer.json"))
    return directory


def make_tiny_export(directory, task: str, dtype: str = "fp32", checkpoint_dir=None, plan: str = "hf-train") -> Path:
    """`longdoc export` of a tiny checkpoint (made next to it unless given)."""
    from longdoc.export.exporter import export_model

    directory = Path(directory)
    if checkpoint_dir is None:
        checkpoint_dir = make_tiny_checkpoint(directory.parent / f"{directory.name}-checkpoint", task)
    export_model(checkpoint_dir, directory, task, dtype=dtype, plan=plan, progress=lambda _msg: None)
    return directory


def read_json(path) -> dict:
    return json.loads(Path(path).read_text())


def make_tiny_longformer(directory, task: str, seed: int = 0, **overrides) -> Path:
    """A random-init Longformer checkpoint saved by transformers (LongformerForQuestionAnswering or
    LongformerForSequenceClassification) with the tiny tokenizer: hidden 32, 2 heads, 2 layers,
    attention_window 16 (w = 8: blocks of 8 tokens under a band of 8), 518 positions.
    initializer_range 0.1 and non-zero biases make a wrong window or global token show."""
    import torch
    import transformers

    kwargs = dict(vocab_size=vocab_size(), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                  intermediate_size=48, max_position_embeddings=520, attention_window=16, initializer_range=0.1,
                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=PAD, sep_token_id=SEP,
                  bos_token_id=CLS, eos_token_id=SEP)
    cls = {"qa": transformers.LongformerForQuestionAnswering,
           "classify": transformers.LongformerForSequenceClassification}[task]
    if task == "classify":
        kwargs.update(num_labels=3, id2label=dict(enumerate(CLASSIFY_LABELS)),
                      label2id={v: k for k, v in enumerate(CLASSIFY_LABELS)})
    torch.manual_seed(seed)
    module = cls(transformers.LongformerConfig(**dict(kwargs, **overrides))).eval()
    nudge_vectors(module, 0.05)
    directory = Path(directory)
    module.save_pretrained(directory, safe_serialization=True)
    tiny_tokenizer().save(str(directory / "tokenizer.json"))
    return directory


def make_tiny_modernbert(directory, task: str, seed: int = 0, **overrides) -> Path:
    """A random-init ModernBERT checkpoint saved by transformers (ModernBertForQuestionAnswering,
    ModernBertForSequenceClassification or ModernBertForMaskedLM) with the tiny tokenizer: hidden 64,
    4 heads, 4 layers (full, sliding, full, sliding: global every 2), local_attention 16 (a band of
    8 tokens each side, blocks of 8), rotary bases 2000 (full) and 50 (sliding), 512 positions.
    initializer_range 0.1 and nudged norms make a wrong band, base or norm show."""
    import torch
    import transformers

    kwargs = dict(vocab_size=vocab_size(), hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=4, local_attention=16, global_attn_every_n_layers=2, global_rope_theta=2000.0,
                  local_rope_theta=50.0, max_position_embeddings=512, initializer_range=0.1, pad_token_id=PAD,
                  bos_token_id=CLS, cls_token_id=CLS, eos_token_id=SEP, sep_token_id=SEP, attn_implementation="eager")
    cls = {"qa": transformers.ModernBertForQuestionAnswering, "mlm": transformers.ModernBertForMaskedLM,
           "classify": transformers.ModernBertForSequenceClassification}[task]
    if task == "classify":
        kwargs.update(num_labels=3, id2label=dict(enumerate(CLASSIFY_LABELS)),
                      label2id={v: k for k, v in enumerate(CLASSIFY_LABELS)})
    torch.manual_seed(seed)
    module = cls(transformers.ModernBertConfig(**dict(kwargs, **overrides))).eval()
    nudge_vectors(module, 0.05)
    directory = Path(directory)
    module.save_pretrained(directory, safe_serialization=True)
    tiny_tokenizer().save(str(directory / "tokenizer.json"))
    return directory


SENTENCE_FAMILIES = ("bert", "big_bird", "modernbert")


def make_tiny_sentence_transformer(directory, family: str = "bert", pooling: str = "mean", normalize: bool = True,
                                   max_seq_length: int | None = 128, seed: int = 0, **overrides) -> Path:
    """A sentence-transformers folder as `SentenceTransformer.save` writes one, around a random-init bare
    encoder saved by transformers (BertModel: hidden 32, 2 layers, 2 heads, 512 positions; BigBirdModel:
    the tiny BigBird's shape; ModernBertModel: `make_tiny_modernbert`'s) with the tiny tokenizer:
    modules.json (Transformer, Pooling[, Normalize]), 1_Pooling/config.json (`pooling`: "mean", "cls"
    or another sentence-transformers mode), sentence_bert_config.json (`max_seq_length`)."""
    import torch
    import transformers

    directory = Path(directory)
    torch.manual_seed(seed)
    if family == "bert":
        config = transformers.BertConfig(
            vocab_size=vocab_size(), hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=512, pad_token_id=PAD, initializer_range=0.25, **overrides)
        module = transformers.BertModel(config)
    elif family == "big_bird":
        config = transformers.BigBirdConfig(**{**tiny_config("mlm"), **overrides})
        module = transformers.BigBirdModel(config)
    elif family == "modernbert":
        config = transformers.ModernBertConfig(**{**dict(
            vocab_size=vocab_size(), hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            local_attention=16, global_attn_every_n_layers=2, global_rope_theta=2000.0, local_rope_theta=50.0,
            max_position_embeddings=512, initializer_range=0.1, pad_token_id=PAD, bos_token_id=CLS, cls_token_id=CLS,
            eos_token_id=SEP, sep_token_id=SEP, attn_implementation="eager"), **overrides})
        module = transformers.ModernBertModel(config)
    else:
        raise ValueError(f"family must be one of {SENTENCE_FAMILIES}")
    nudge_vectors(module.eval(), 0.05)
    module.save_pretrained(directory, safe_serialization=True)
    tiny_tokenizer().save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(  # what sentence-transformers' AutoTokenizer reads
        {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "[PAD]", "cls_token": "[CLS]", "sep_token": "[SEP]"}))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (directory / "modules.json").write_text(json.dumps(modules, indent=2))
    (directory / "1_Pooling").mkdir()
    modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens")
    wanted = {"cls": "cls_token", "mean": "mean_tokens"}.get(pooling, pooling)
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": config.hidden_size, **{f"pooling_mode_{m}": m == wanted for m in modes}}))
    st_config = {"do_lower_case": False} if max_seq_length is None else {"max_seq_length": max_seq_length,
                                                                           "do_lower_case": False}
    (directory / "sentence_bert_config.json").write_text(json.dumps(st_config))
    return directory


def make_tiny_encoder_decoder(directory, seed: int = 0, **overrides) -> Path:
    """A transformers EncoderDecoderModel saved with the tiny tokenizer: block_size 16, 2 random
    blocks (full attention up to 144 tokens), 512 encoder positions, 64 decoder positions;
    decoder start [CLS], eos [SEP], the BERT2BERT way. `overrides` change fields of both the
    encoder's and the decoder's config."""
    import torch
    import transformers

    directory = Path(directory)
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size(), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                  intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                  initializer_range=0.25, pad_token_id=PAD)
    common.update(overrides)
    enc = transformers.BigBirdConfig(**common, max_position_embeddings=512, block_size=16, num_random_blocks=2,
                                     sep_token_id=SEP)
    dec = transformers.BertConfig(**common, max_position_embeddings=64, is_decoder=True, add_cross_attention=True)
    cfg = transformers.EncoderDecoderConfig.from_encoder_decoder_configs(enc, dec)
    cfg.decoder_start_token_id, cfg.pad_token_id, cfg.eos_token_id = CLS, PAD, SEP
    model = transformers.EncoderDecoderModel(cfg).eval()
    with torch.no_grad():  # a non-zero output bias, and eos likely enough to end some summaries
        model.decoder.cls.predictions.bias.normal_(0, 0.5)
        model.decoder.cls.predictions.bias[SEP] += 2.0
    model.save_pretrained(directory)
    tiny_tokenizer().save(str(directory / "tokenizer.json"))
    return directory


def make_tiny_led(directory, seed: int = 0, **overrides) -> Path:
    """A random-init transformers LEDForConditionalGeneration with the tiny tokenizer: d_model 32,
    2 heads, 2 + 2 layers, attention_window 16 (w = 8), 512 encoder and 64 decoder positions;
    large init_std, non-zero biases and final_logits_bias (eos favoured, so that some summaries end).
    LED's special ids (bos 0, pad 1, eos 2, decoder start 2) come from the config; the tokenizer is
    only used to turn text into ids."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = dict(vocab_size=vocab_size(), d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
               decoder_attention_heads=2, encoder_ffn_dim=48, decoder_ffn_dim=48, max_encoder_position_embeddings=512,
               max_decoder_position_embeddings=64, attention_window=16, dropout=0.0, attention_dropout=0.0,
               activation_dropout=0.0, init_std=0.2)
    cfg.update(overrides)
    model = transformers.LEDForConditionalGeneration(transformers.LEDConfig(**cfg)).eval()
    nudge_vectors(model, 0.05)
    with torch.no_grad():
        model.final_logits_bias.normal_(std=0.5)
        model.final_logits_bias[0, 2] = 4.5  # LED's eos (bos 0, pad 1, eos 2)
    directory = Path(directory)
    model.save_pretrained(directory)
    tiny_tokenizer().save(str(directory / "tokenizer.json"))
    return directory


SLOW_TOKENIZER_CLASSES = {"bigbird": "BigBirdTokenizer", "pegasus": "PegasusTokenizer", "longformer": "LongformerTokenizer",
                          "led": "LEDTokenizer", "bert": "BertTokenizer"}


def write_slow_tokenizer(directory, family: str) -> Path:
    """Replace a checkpoint's tokenizer.json by the files the family's public checkpoints ship
    instead, with tokenizer_config.json naming the class: a SentencePiece spiece.model (bigbird:
    BigBird's specials [CLS] [SEP] [MASK] <pad> <s> </s> <unk>; pegasus: pad 0, eos 1, unk 2, the
    103 offset ids added by the tokenizer), vocab.json + merges.txt (longformer, led: byte-level BPE
    with <s> <pad> </s> <unk> <mask>) or vocab.txt (bert: WordPiece). Trained on TINY_WORDS text;
    every id stays below the tiny models' vocab_size()."""
    import random

    directory = Path(directory)
    (directory / "tokenizer.json").unlink(missing_ok=True)
    rng = random.Random(0)
    corpus = directory / "corpus.txt.tmp"
    corpus.write_text("\n".join(" ".join(rng.choice(TINY_WORDS) for _ in range(12)) for _ in range(2000)))
    try:
        if family in ("bigbird", "pegasus"):
            import sentencepiece

            ids = (dict(pad_id=0, bos_id=1, eos_id=2, unk_id=3, user_defined_symbols=["[SEP]", "[CLS]", "[MASK]"])
                   if family == "bigbird" else dict(pad_id=0, eos_id=1, unk_id=2, bos_id=-1))
            sentencepiece.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(directory / "spiece"),
                                                     vocab_size=300, model_type="unigram", minloglevel=2, **ids)
            (directory / "spiece.vocab").unlink()
        elif family in ("longformer", "led"):
            from tokenizers import ByteLevelBPETokenizer

            bpe = ByteLevelBPETokenizer()
            bpe.train([str(corpus)], vocab_size=400, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
                      show_progress=False)
            bpe.save_model(str(directory))
        elif family == "bert":
            (directory / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]",
                                                            *dict.fromkeys(TINY_WORDS)]) + "\n")
        else:
            raise ValueError(f"family must be one of {', '.join(SLOW_TOKENIZER_CLASSES)}")
    finally:
        corpus.unlink()
    config = {"tokenizer_class": SLOW_TOKENIZER_CLASSES[family]}
    if family == "bert":
        config["do_lower_case"] = True
    (directory / "tokenizer_config.json").write_text(json.dumps(config) + "\n")
    return directory
