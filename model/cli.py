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
    from longdoc.model.train_config import add_train_arguments

    add_train_arguments(p)  # one flag per TrainConfig field, its help and default written there
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
    from longdoc.model.train import train
    from longdoc.model.train_config import config_from_args

    config = config_from_args(args)
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
