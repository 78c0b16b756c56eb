"""`longdoc train` and `longdoc warmstart`. Nothing heavy is imported here: torch loads inside
the command functions, so `longdoc serve` works without it."""

from __future__ import annotations


def add_commands(subparsers) -> None:
    p = subparsers.add_parser(
        "train",
        help="train or fine-tune a BigBird model (mlm, qa, classify, summarize)",
        description=(
            "Train with block-sparse attention and a fixed random-block plan. Writes "
            "OUTPUT/checkpoint-STEP/ (resumable) and the final model in OUTPUT/ (Hugging Face format). "
            "Data formats: docs/training.md."
        ),
    )
    p.add_argument("--task", required=True, choices=("mlm", "qa", "classify", "summarize"), help="training objective")
    p.add_argument("--model", required=True, help="checkpoint dir to start from, or a config.json (random init)")
    p.add_argument("--train", required=True, help="training JSONL")
    p.add_argument("--eval", default=None,
                   help="evaluation JSONL (eval loss every --eval-every steps; default: no evaluation)")
    p.add_argument("--output", required=True, help="output directory")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json or its dir (default: the model's dir)")
    p.add_argument("--max-length", type=int, default=None, help="encoder tokens (default: max_position_embeddings)")
    p.add_argument("--max-target-length", type=int, default=256, help="summarize: summary tokens")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=5e-5, help="peak learning rate (AdamW, linear decay)")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    p.add_argument("--warmup-steps", type=int, default=None, help="default: --warmup-ratio of the steps")
    p.add_argument("--warmup-ratio", type=float, default=0.06, help="share of the steps warming up")
    p.add_argument("--epochs", type=float, default=1.0, help="passes over the training data")
    p.add_argument("--max-steps", type=int, default=None,
                   help="optimizer steps, overriding --epochs (default: from --epochs)")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping norm")
    p.add_argument("--log-every", type=int, default=10, help="optimizer steps between log lines")
    p.add_argument("--eval-every", type=int, default=500, help="0: only at the end")
    p.add_argument("--save-every", type=int, default=500, help="0: only at the end")
    p.add_argument("--keep-checkpoints", type=int, default=2, help="newest OUTPUT/checkpoint-* kept")
    p.add_argument("--freeze-encoder", action="store_true",
                   help="summarize: train the decoder only, the encoder keeps its weights (default: off)")
    p.add_argument("--precision", choices=("auto", "fp32", "bf16", "fp16"), default="auto",
                   help="auto: bf16 autocast on CUDA where supported, else fp16; fp32 on CPU. "
                        "bf16 works on CPU too, fp16 only on CUDA (default: auto)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--seed", type=int, default=0, help="random seed (initialization, data order, masking)")
    p.add_argument("--plan", choices=("hf-train", "hf-eval", "seeded"), default="hf-train",
                   help="random-block plan (hf-train: the blocks the public checkpoints were trained with)")
    p.add_argument("--resume", nargs="?", const="latest", default=None,
                   help="continue from the latest OUTPUT/checkpoint-* (or the given checkpoint dir; "
                        "default: start afresh)")
    p.add_argument("--mlm-probability", type=float, default=0.15, help="mlm: share of tokens masked")
    p.add_argument("--qa-long-context", choices=("window", "truncate"), default="window",
                   help="qa: contexts longer than max-length become overlapping windows, or are cut")
    p.add_argument("--doc-stride", type=int, default=256, help="qa windows: context tokens between window starts")
    p.add_argument("--max-question-length", type=int, default=64, help="qa: question tokens kept")
    p.add_argument("--qa-negative-windows", type=float, default=1.0,
                   help="qa windows: share of windows without the answer that is kept (0: only answer windows)")
    p.add_argument("--labels", default=None, help="classify: comma-separated label names (default: from the data)")
    p.add_argument("--dropout", type=float, default=None,
                   help="override the config's dropout probabilities (default: the config's)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=_train)

    w = subparsers.add_parser(
        "warmstart",
        help="make a long-context BigBird checkpoint from a BERT/RoBERTa/BigBird encoder",
        description="Copy the encoder; grow the position table to --max-length by repeating it (BigBird paper).",
    )
    w.add_argument("source", help="checkpoint dir (config.json + model.safetensors | pytorch_model.bin)")
    w.add_argument("destination", help="output dir")
    w.add_argument("--max-length", type=int, default=4096, help="positions of the new checkpoint")
    w.add_argument("--block-size", type=int, default=64, help="block-sparse attention block size")
    w.add_argument("--num-random-blocks", type=int, default=3, help="random key blocks per query block")
    w.add_argument("--encoder-decoder", action="store_true",
                   help="write a BigBird encoder + BERT decoder (transformers' EncoderDecoderModel, the BERT2BERT "
                        "recipe): both from SOURCE, cross-attention freshly initialised (default: off, a BigBird encoder)")
    w.add_argument("--cross-attention", choices=("fresh", "self"), default="fresh",
                   help="--encoder-decoder: fresh = BERT-initialised cross-attention (Rothe et al.); self = a copy "
                        "of each decoder layer's self-attention, which reads the document from the first step "
                        "(default: fresh)")
    w.add_argument("--decoder-max-length", type=int, default=None,
                   help="--encoder-decoder: decoder positions (default: the source's position table size)")
    w.set_defaults(func=_warmstart)


def _train(args) -> int:
    from longdoc.model.train import TrainConfig, train

    config = TrainConfig(
        task=args.task,
        model=args.model,
        train=args.train,
        eval=args.eval,
        output=args.output,
        tokenizer=args.tokenizer,
        max_length=args.max_length,
        max_target_length=args.max_target_length,
        batch_size=args.batch_size,
        grad_accum=args.grad_accum,
        lr=args.lr,
        weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps,
        warmup_ratio=args.warmup_ratio,
        epochs=args.epochs,
        max_steps=args.max_steps,
        max_grad_norm=args.max_grad_norm,
        log_every=args.log_every,
        eval_every=args.eval_every,
        save_every=args.save_every,
        keep_checkpoints=args.keep_checkpoints,
        precision=args.precision,
        freeze_encoder=args.freeze_encoder,
        device=args.device,
        seed=args.seed,
        plan=args.plan,
        resume=args.resume or False,
        mlm_probability=args.mlm_probability,
        qa_long_context=args.qa_long_context,
        doc_stride=args.doc_stride,
        max_question_length=args.max_question_length,
        qa_negative_windows=args.qa_negative_windows,
        labels=[s.strip() for s in args.labels.split(",")] if args.labels else None,
        dropout=args.dropout,
        quiet=args.quiet,
    )
    result = train(config)
    print(f"{result.output} step {result.step} train_loss {result.train_loss:.4f}"
          + (f" eval_loss {result.eval_loss:.4f}" if result.eval_loss is not None else ""))
    return 0


def _warmstart(args) -> int:
    from longdoc.model.warmstart import warm_start, warm_start_encoder_decoder

    if args.encoder_decoder:
        record = warm_start_encoder_decoder(args.source, args.destination, args.max_length,
                                            decoder_max_length=args.decoder_max_length, block_size=args.block_size,
                                            num_random_blocks=args.num_random_blocks,
                                            cross_attention=args.cross_attention)
        print(f"{args.destination}: {record['source_model_type']} -> encoder-decoder (big_bird encoder, bert "
              f"decoder), positions {record['source_positions']} -> {record['max_length']} (encoder), "
              f"{record['decoder_max_length']} (decoder); initialised: {len(record['initialised_keys'])} tensors")
        return 0
    if args.decoder_max_length is not None:
        raise ValueError("--decoder-max-length needs --encoder-decoder")
    record = warm_start(
        args.source,
        args.destination,
        args.max_length,
        block_size=args.block_size,
        num_random_blocks=args.num_random_blocks,
    )
    print(f"{args.destination}: {record['source_model_type']} -> big_bird, positions "
          f"{record['source_positions']} -> {record['max_length']} ({record['position_rule']})")
    return 0
