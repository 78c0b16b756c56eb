"""One training loop for every task: MLM pretraining and fine-tuning for QA spans,
classification and summarization (teacher forcing). `longdoc train` (model/cli.py) and
`train(TrainConfig)` are the two doors; both end here.

    JSONL -> longdoc.model.data features -> length-grouped batches -> collator -> model (block-sparse,
    fixed plan) -> task loss -> AdamW (linear warm-up and decay, clipping, accumulation)
    -> OUTPUT/checkpoint-STEP/ (HF format + training_state.pt) ... -> OUTPUT/ (final model)

Decisions, and why:
- The random blocks follow a fixed plan, "hf-train" by default: exactly the blocks transformers
  draws in training mode and the original TF code uses at all times, i.e. what the public
  checkpoints were trained with. Fine-tuning them with other blocks would shift every layer's
  inputs; and a plan fixed in (layer, length) means the blocks seen in training are the blocks
  served (the export computes the same layout). Short batches (padded length <= (5 + 2r) *
  block_size) run full attention, by the same rule as inference (`longdoc.model.lengths`).
- Losses are computed here from the logits, in fp32, so an all-ignored batch gives 0, not NaN,
  and the MLM head only runs on the masked positions (the (B, S, vocab) logits of a 4096-token
  batch would be most of the memory).
- Precision: "auto" is fp32 on CPU and, on CUDA, bf16 autocast where supported, else fp16 autocast
  with a gradient scaler. "bf16" also runs on CPU (autocast; fast where the CPU has bf16 dot
  products, e.g. AVX-512 BF16 or AMX: measure before choosing it). Master weights and
  optimizer state stay fp32.
- A checkpoint is an ordinary Hugging Face model dir (`longdoc.model.save_pretrained`: transformers'
  `from_pretrained` loads it) plus `training_state.pt` (optimizer, scheduler, scaler, step, data
  position, RNG states: tensors and plain values only, read back with `weights_only=True`) and
  `trainer_state.json` (the same, human-readable, with the loss history). Resuming restores all
  of it, so a resumed run takes the same steps as an uninterrupted one.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from longdoc.model import data as D
from longdoc.model.config import read_json_object
from longdoc.model.registry import lookup, model_types_for, summarize_input_of
from longdoc.model.train_config import TrainConfig  # noqa: F401 (the one description of a run; re-exported)

STATE_FILE = "training_state.pt"
STATE_JSON = "trainer_state.json"
TRAINING_JSON = "training.json"
# keys a task model may lack in a checkpoint (they are initialised fresh): its head
HEAD_PREFIXES = {
    "mlm": ("cls.",),
    "qa": ("qa_classifier.",),
    "classify": ("classifier.", "bert.pooler."),
    "summarize": ("final_logits_bias",),
}
# keys a checkpoint may hold that the task model does not use (another task's head), dropped
OTHER_HEAD_PREFIXES = ("cls.", "qa_classifier.", "classifier.", "bert.pooler.", "lm_head.", "final_logits_bias")


@dataclass
class TrainResult:
    output: Path
    step: int
    train_loss: float  # mean loss over the last log window
    eval_loss: float | None
    history: list[dict] = field(default_factory=list)


# ----------------------------------------------------------------------------- model building


def _model_config_source(model: str) -> tuple[dict, Path | None]:
    """(config dict, checkpoint dir or None for random init)."""
    path = Path(model)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path}: no config.json")
        return read_json_object(path / "config.json"), path
    if path.is_file():
        return read_json_object(path), None
    raise ValueError(f"--model {model}: no such directory or config file")


def _check_task_config(task: str, config: dict, where: str) -> None:
    model_type = config.get("model_type")
    record = lookup(model_type)
    if record is None or task not in record.train_tasks:
        want = model_types_for(task, training=True)
        raise ValueError(f"{where}: task {task!r} needs a {' or '.join(map(repr, want))} model, the config says "
                         f"model_type {model_type!r}")


def _encoder_view(config: dict, max_target_length: int) -> dict:
    """What the data code reads of a model config (vocab_size, max_position_embeddings, the
    special token ids): the encoder's config (an encoder-decoder's nested one) with the top-level
    token ids (the ones transformers' EncoderDecoderModel uses), after checking a separate decoder
    position table holds --max-target-length."""
    decoder = config.get("decoder")
    if isinstance(decoder, dict):  # an encoder-decoder's own decoder config
        decoder_positions = decoder.get("max_position_embeddings", 512)
        if max_target_length > decoder_positions:
            raise ValueError(f"max_target_length {max_target_length} exceeds the decoder's max_position_embeddings "
                             f"{decoder_positions}")
    return {**lookup(config.get("model_type")).encoder_config(config),
            **{k: v for k, v in config.items() if k.endswith("_token_id")}}


def build_model(task: str, config: dict, plan: str, labels: list[str] | None = None, dropout: float | None = None) -> nn.Module:
    """A randomly initialised task model for a config dict (`Architecture.build_for_training`)."""
    return lookup(config.get("model_type")).build_for_training(task, config, plan, labels, dropout)


def load_weights(module: nn.Module, task: str, directory: Path, log=print) -> None:
    """Load a checkpoint dir's tensors into a task model built for it. The encoder must be
    complete; the task head may be missing (then it keeps its fresh init: warm start or a new
    task), and other tasks' heads in the file are dropped. Both are logged; anything else that
    does not fit (missing encoder keys, unknown keys, shapes) is a LoadError listing the keys."""
    from longdoc.model.checkpoint import IGNORED_ALWAYS, load_state_dict_strict, read_state_dict

    state = read_state_dict(directory)
    # a bare BigBirdModel checkpoint (transformers writes it without the "bert." prefix)
    if any(k.startswith("bert.") for k in module.state_dict()) and not any(k.startswith("bert.") for k in state):
        state = {(f"bert.{k}" if k.startswith(("embeddings.", "encoder.", "pooler.")) else k): v for k, v in state.items()}
    fresh, dropped = load_state_dict_strict(
        module, state, ignored=IGNORED_ALWAYS, source=str(directory),
        fresh_prefixes=HEAD_PREFIXES[task], drop_prefixes=OTHER_HEAD_PREFIXES,
    )
    if fresh:
        log(f"initialised fresh (not in {directory}): {', '.join(fresh)}")
    if dropped:
        log(f"not used from {directory}: {', '.join(dropped)}")


def load_tokenizer(model: str, tokenizer: str | None):
    """(tokenizers.Tokenizer without truncation or padding (the data code does both), its file):
    `tokenizer` (a tokenizer.json or its dir), else the model's dir, read by the one loader
    (`longdoc.model.tokenization.load_tokenizer`: a checkpoint that ships only spiece.model or
    vocab.json + merges.txt is named with the command that converts it)."""
    from longdoc.model.tokenization import TOKENIZER_NAME, TokenizerError, load_tokenizer as load

    if tokenizer is None:
        path = Path(model)
        tokenizer = str(path if path.is_dir() else path.parent)
    path = Path(tokenizer)
    if path.is_file():  # a tokenizer.json under another name
        path, tok = path, load_file_tokenizer(path)
    elif path.is_dir():
        try:
            tok = load(path)
        except TokenizerError as e:
            raise ValueError(f"{e} (or pass --tokenizer DIR_OR_FILE)") from None
        path = path / TOKENIZER_NAME
    else:
        raise ValueError(f"no tokenizer at {path} (pass --tokenizer DIR_OR_FILE)")
    tok.no_truncation()
    tok.no_padding()
    return tok, path


def load_file_tokenizer(path: Path):
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the library raises plain Exception subclasses for malformed files
        raise ValueError(f"{path}: not a readable tokenizers file ({e})") from None


def _copy_tokenizer_files(tokenizer_path: Path, directory: Path) -> None:
    from longdoc.model.warmstart import TOKENIZER_FILES

    for name in TOKENIZER_FILES:
        source = tokenizer_path.parent / name
        if source.is_file() and source.resolve() != (directory / name).resolve():
            shutil.copyfile(source, directory / name)


# ----------------------------------------------------------------------------- losses


def task_loss(task: str, module: nn.Module, batch: dict) -> torch.Tensor:
    """Mean loss of one batch, computed in fp32 from the model's logits."""
    if task == "mlm":
        hidden = module.bert(batch["input_ids"], batch["attention_mask"]).last_hidden_state  # (B, S, H)
        chosen = batch["labels"] != D.IGNORE_INDEX  # (B, S)
        if not bool(chosen.any()):
            return hidden.sum() * 0.0
        logits = module.cls(hidden[chosen])  # (N, vocab), N masked positions
        return F.cross_entropy(logits.float(), batch["labels"][chosen])
    if task == "qa":
        out = module(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], token_type_ids=batch["token_type_ids"]
        )
        start = F.cross_entropy(out.start_logits.float(), batch["start_positions"])
        end = F.cross_entropy(out.end_logits.float(), batch["end_positions"])
        return (start + end) / 2
    if task == "classify":
        out = module(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        return F.cross_entropy(out.logits.float(), batch["labels"])
    if task == "summarize":
        out = module(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            decoder_input_ids=batch["decoder_input_ids"],
            decoder_attention_mask=batch["decoder_attention_mask"],
        )
        logits = out.logits.float()  # (B, T, vocab)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1), ignore_index=D.IGNORE_INDEX)
    raise ValueError(f"unknown task {task!r}")


# ----------------------------------------------------------------------------- the loop


def linear_schedule(warmup: int, total: int):
    """LR multiplier: 0 -> 1 over `warmup` steps, then linearly to 0 at `total`."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        return max(0.0, (total - step) / max(1, total - warmup))

    return factor


def freeze_encoder(model: nn.Module) -> int:
    """Stop training an encoder-decoder's encoder (requires_grad off; the optimizer skips it),
    except the tensors it shares with the decoder (Pegasus' tied word table). Why: training the
    MiniLM BERT2BERT's encoder from the first step collapsed it, every token of every page mapped
    to nearly one vector, and the decoder learned to ignore the page (docs/notes/summarizer-training.md).
    Returns the number of tensors frozen."""
    inner = getattr(model, "model", model)  # Pegasus / LED keep encoder and decoder under .model
    shared = {id(p) for p in inner.decoder.parameters()}
    frozen = [p for p in inner.encoder.parameters() if id(p) not in shared]
    for p in frozen:
        p.requires_grad_(False)
    return len(frozen)


def _parameter_groups(module: nn.Module, weight_decay: float) -> list[dict]:
    """No weight decay on biases, LayerNorm weights and embeddings' padding (BERT practice)."""
    decay, no_decay, seen = [], [], set()
    for name, p in module.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (no_decay if p.ndim < 2 or "LayerNorm" in name or "layer_norm" in name else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device available")
    return device


def _resolve_precision(name: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype (None = plain fp32)."""
    if name not in ("auto", "fp32", "bf16", "fp16"):
        raise ValueError(f"precision must be auto, fp32, bf16 or fp16, got {name!r}")
    if device.type != "cuda":
        if name == "fp16":
            raise ValueError("--precision fp16 needs a CUDA device; on CPU use bf16 or fp32")
        return torch.bfloat16 if name == "bf16" else None
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def _checkpoints(output: Path) -> list[Path]:
    found = [p for p in output.glob("checkpoint-*") if p.is_dir() and re.fullmatch(r"checkpoint-\d+", p.name)]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


class Trainer:
    """State of one run; `run()` trains to the end. Built by `train(TrainConfig)`."""

    def __init__(self, cfg: TrainConfig):
        if cfg.task not in D.TASKS:
            raise ValueError(f"unknown task {cfg.task!r}; expected one of {', '.join(D.TASKS)}")
        if cfg.batch_size < 1 or cfg.grad_accum < 1:
            raise ValueError("batch_size and grad_accum must be >= 1")
        if cfg.freeze_encoder and cfg.task != "summarize":
            raise ValueError(f"freeze_encoder is for --task summarize (an encoder-decoder), not {cfg.task!r}")
        self.cfg = cfg
        self.output = Path(cfg.output)
        self.device = _resolve_device(cfg.device)
        self.autocast_dtype = _resolve_precision(cfg.precision, self.device)
        torch.manual_seed(cfg.seed)

        # where the weights come from: a checkpoint to resume, the --model dir, or random init
        self.resume_dir = self._find_resume()
        model_config, source_dir = _model_config_source(str(self.resume_dir or cfg.model))
        _check_task_config(cfg.task, model_config, str(self.resume_dir or cfg.model))
        self.tokenizer, self.tokenizer_path = load_tokenizer(cfg.model, cfg.tokenizer)
        data_config = _encoder_view(model_config, cfg.max_target_length)
        if self.tokenizer.get_vocab_size() > data_config.get("vocab_size", 0):
            raise ValueError(
                f"the tokenizer has {self.tokenizer.get_vocab_size()} tokens, the model's vocab_size is "
                f"{data_config.get('vocab_size')}"
            )
        self.special = D.special_tokens_from(self.tokenizer, data_config, self.tokenizer_path.parent)
        self.summarize_input = summarize_input_of(model_config.get("model_type"))  # what the export will serve
        max_positions = data_config.get("max_position_embeddings", 4096)
        self.max_length = cfg.max_length or max_positions
        if self.max_length > max_positions:
            raise ValueError(f"max_length {self.max_length} exceeds the model's max_position_embeddings {max_positions}")

        # data
        train_records = D.read_jsonl(cfg.train, cfg.task)
        eval_records = D.read_jsonl(cfg.eval, cfg.task) if cfg.eval else None
        labels = None
        if cfg.task == "classify":
            labels = self._labels(model_config, train_records)
        self.labels = labels
        self.train_features = self._features(train_records)
        if not self.train_features:
            raise D.DataError(f"{cfg.train}: no training sequences (every text is empty?)")
        self.eval_features = self._features(eval_records) if eval_records else None

        # model
        self.model = build_model(cfg.task, model_config, cfg.plan, labels, cfg.dropout)
        if source_dir is not None:
            load_weights(self.model, cfg.task, source_dir, log=self.log)
        self.model.to(self.device)
        if cfg.freeze_encoder:
            self.log(f"encoder frozen: {freeze_encoder(self.model)} tensors not trained")

        # optimisation
        lengths = [len(f["input_ids"]) for f in self.train_features]
        self.batches_per_epoch = math.ceil(len(lengths) / cfg.batch_size)
        self.total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * self.batches_per_epoch / cfg.grad_accum))
        self.warmup_steps = cfg.warmup_steps if cfg.warmup_steps is not None else int(cfg.warmup_ratio * self.total_steps)
        self.optimizer = torch.optim.AdamW(
            _parameter_groups(self.model, cfg.weight_decay), lr=cfg.lr, betas=tuple(cfg.adam_betas), eps=cfg.adam_eps
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, linear_schedule(self.warmup_steps, self.total_steps))
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.autocast_dtype == torch.float16)
        self.mask_generator = torch.Generator().manual_seed(cfg.seed + 1)
        self.step = 0  # optimizer steps taken
        self.epoch = 0
        self.batch_index = 0  # next batch of this epoch
        self.history: list[dict] = []
        if self.resume_dir is not None:
            self._load_state(self.resume_dir)

    # --- set-up helpers

    def log(self, message: str) -> None:
        if not self.cfg.quiet:
            print(message, file=sys.stderr, flush=True)

    def _find_resume(self) -> Path | None:
        resume = self.cfg.resume
        if not resume:
            return None
        if resume is True or resume == "latest":
            found = _checkpoints(self.output)
            if not found:
                raise ValueError(f"--resume: no checkpoint-* directory in {self.output}")
            return found[-1]
        path = Path(resume)
        if not (path / STATE_FILE).is_file():
            raise ValueError(f"--resume {path}: not a training checkpoint (no {STATE_FILE})")
        return path

    def _labels(self, model_config: dict, records) -> list[str]:
        if self.cfg.labels:
            return list(self.cfg.labels)
        id2label = model_config.get("id2label")
        if id2label and not all(re.fullmatch(r"LABEL_\d+", str(v)) for v in id2label.values()):
            return [str(id2label[k]) for k in sorted(id2label, key=int)]
        return D.labels_of(records)

    def _features(self, records) -> list[dict]:
        cfg, tok, special = self.cfg, self.tokenizer, self.special
        if cfg.task == "mlm":
            return D.mlm_features(records, tok, special, self.max_length)
        if cfg.task == "qa":
            return D.qa_features(
                records,
                tok,
                special,
                self.max_length,
                long_context=cfg.qa_long_context,
                doc_stride=cfg.doc_stride,
                max_question_length=cfg.max_question_length,
                negative_windows=cfg.qa_negative_windows,
                seed=cfg.seed,
            )
        if cfg.task == "classify":
            return D.classify_features(records, tok, special, self.max_length, {n: i for i, n in enumerate(self.labels)})
        return D.summarize_features(records, tok, special, self.max_length, cfg.max_target_length,
                                    self.summarize_input)

    def _collate(self, features, generator=None) -> dict:
        task, special = self.cfg.task, self.special
        if task == "mlm":
            batch = D.collate_mlm(features, special, generator or self.mask_generator, self.cfg.mlm_probability)
        elif task == "qa":
            batch = D.collate_qa(features, special)
        elif task == "classify":
            batch = D.collate_classify(features, special)
        else:
            batch = D.collate_summarize(features, special)
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    # --- state

    def _state(self) -> dict:
        state = {
            "step": self.step,
            "epoch": self.epoch,
            "batch_index": self.batch_index,
            "total_steps": self.total_steps,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "rng_torch": torch.get_rng_state(),
            "rng_mask": self.mask_generator.get_state(),
        }
        if self.device.type == "cuda":
            state["rng_cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def _load_state(self, directory: Path) -> None:
        state = torch.load(directory / STATE_FILE, map_location="cpu", weights_only=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        torch.set_rng_state(state["rng_torch"])
        self.mask_generator.set_state(state["rng_mask"])
        if "rng_cuda" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng_cuda"], self.device)
        self.step, self.epoch, self.batch_index = int(state["step"]), int(state["epoch"]), int(state["batch_index"])
        if int(state["total_steps"]) != self.total_steps:
            self.log(f"note: total steps {state['total_steps']} -> {self.total_steps}; the LR schedule follows the new total")
        history_path = directory / STATE_JSON
        if history_path.is_file():
            self.history = json.loads(history_path.read_text()).get("history", [])
        self.log(f"resumed from {directory} at step {self.step} (epoch {self.epoch}, batch {self.batch_index})")

    def _save_model(self, directory: Path) -> None:
        from longdoc.model.checkpoint import save_pretrained

        directory.mkdir(parents=True, exist_ok=True)
        save_pretrained(self.model, directory)
        _copy_tokenizer_files(self.tokenizer_path, directory)
        if not (directory / "special_tokens_map.json").is_file():
            # the ids training used, by text, for longdoc.model.tokenization (export, service) to find
            tokens = D.special_tokens_map(self.tokenizer, self.special)
            (directory / "special_tokens_map.json").write_text(json.dumps(tokens, indent=2) + "\n")

    def save_checkpoint(self) -> Path:
        directory = self.output / f"checkpoint-{self.step}"
        tmp = self.output / f".tmp-checkpoint-{self.step}"
        if tmp.exists():
            shutil.rmtree(tmp)
        self._save_model(tmp)
        torch.save(self._state(), tmp / STATE_FILE)
        (tmp / STATE_JSON).write_text(json.dumps(self._summary(), indent=2) + "\n")
        if directory.exists():
            shutil.rmtree(directory)
        tmp.rename(directory)  # a checkpoint dir is complete or absent
        for old in _checkpoints(self.output)[: -max(1, self.cfg.keep_checkpoints)]:
            shutil.rmtree(old)
        return directory

    def _summary(self) -> dict:
        config = asdict(self.cfg)
        return {
            "step": self.step,
            "epoch": self.epoch,
            "batch_index": self.batch_index,
            "total_steps": self.total_steps,
            "warmup_steps": self.warmup_steps,
            "train_examples": len(self.train_features),
            "config": config,
            "history": self.history,
        }

    # --- evaluation

    @torch.no_grad()
    def evaluate(self) -> float | None:
        if not self.eval_features:
            return None
        self.model.eval()
        generator = torch.Generator().manual_seed(self.cfg.seed + 2)  # the same masks at every evaluation
        total, count = 0.0, 0
        order = sorted(range(len(self.eval_features)), key=lambda i: len(self.eval_features[i]["input_ids"]))
        for i in range(0, len(order), self.cfg.batch_size):
            features = [self.eval_features[j] for j in order[i : i + self.cfg.batch_size]]
            batch = self._collate(features, generator)
            with self._autocast():
                loss = task_loss(self.cfg.task, self.model, batch)
            total += float(loss) * len(features)
            count += len(features)
        self.model.train()
        return total / count

    def _autocast(self):
        if self.autocast_dtype is None:
            return torch.autocast("cpu", enabled=False)
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    # --- training

    def run(self) -> TrainResult:
        cfg = self.cfg
        self.output.mkdir(parents=True, exist_ok=True)
        lengths = [len(f["input_ids"]) for f in self.train_features]
        n_params = sum(p.numel() for p in {id(p): p for p in self.model.parameters()}.values())
        self.log(
            f"{cfg.task}: {len(self.train_features)} training sequences, {n_params / 1e6:.2f}M parameters, "
            f"{self.total_steps} steps (warm-up {self.warmup_steps}), batch {cfg.batch_size} x {cfg.grad_accum}, "
            f"max_length {self.max_length}, device {self.device}, "
            f"precision {self.autocast_dtype or torch.float32}, plan {cfg.plan}"
        )
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        window_loss, window_batches, window_tokens, window_start = 0.0, 0, 0, time.perf_counter()
        last_loss, eval_loss = float("nan"), None
        micro = 0
        while self.step < self.total_steps:
            batches = D.length_grouped_batches(lengths, cfg.batch_size, cfg.seed, self.epoch)
            while self.batch_index < len(batches) and self.step < self.total_steps:
                features = [self.train_features[i] for i in batches[self.batch_index]]
                self.batch_index += 1
                batch = self._collate(features)
                with self._autocast():
                    loss = task_loss(cfg.task, self.model, batch)
                if not torch.isfinite(loss):
                    raise FloatingPointError(f"loss is {float(loss)} at step {self.step + 1}; lower --lr or use fp32")
                self.scaler.scale(loss / cfg.grad_accum).backward()
                window_loss += float(loss.detach())
                window_batches += 1
                window_tokens += D.num_tokens(batch)
                micro += 1
                if micro % cfg.grad_accum:
                    continue
                self.scaler.unscale_(self.optimizer)
                grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm))
                self.scaler.step(self.optimizer)
                self.scaler.update()
                self.optimizer.zero_grad(set_to_none=True)
                lr = self.scheduler.get_last_lr()[0]
                self.scheduler.step()
                self.step += 1
                record = {"step": self.step, "lr": lr, "loss": round(float(loss.detach()), 6), "grad_norm": round(grad_norm, 4)}
                at_end = self.step >= self.total_steps
                if cfg.eval_every and (self.step % cfg.eval_every == 0) or at_end:
                    eval_loss = self.evaluate()
                    if eval_loss is not None:
                        record["eval_loss"] = round(eval_loss, 6)
                self.history.append(record)
                if self.step % max(cfg.log_every, 1) == 0 or at_end or "eval_loss" in record:
                    seconds = time.perf_counter() - window_start
                    last_loss = window_loss / max(window_batches, 1)
                    self._progress(last_loss, lr, window_tokens / max(seconds, 1e-9), eval_loss if "eval_loss" in record else None)
                    window_loss, window_batches, window_tokens, window_start = 0.0, 0, 0, time.perf_counter()
                if cfg.save_every and self.step % cfg.save_every == 0 and not at_end:
                    self.save_checkpoint()
            if self.batch_index >= len(batches):
                self.epoch += 1
                self.batch_index = 0
        final = self.save_checkpoint()
        self._finish(final)
        return TrainResult(self.output, self.step, last_loss, eval_loss, self.history)

    def _progress(self, loss: float, lr: float, tokens_per_second: float, eval_loss: float | None) -> None:
        width = 20
        done = int(width * self.step / self.total_steps)
        epoch = self.epoch + self.batch_index / max(self.batches_per_epoch, 1)
        line = (
            f"[{'#' * done}{'.' * (width - done)}] step {self.step}/{self.total_steps} "
            f"epoch {epoch:.2f} loss {loss:.4f} lr {lr:.2e} {tokens_per_second:,.0f} tok/s"
        )
        if eval_loss is not None:
            line += f" eval_loss {eval_loss:.4f}"
        self.log(line)

    def _finish(self, final_checkpoint: Path) -> None:
        """The final model in OUTPUT/ itself (HF format + tokenizer + training.json)."""
        self._save_model(self.output)
        summary = self._summary()
        summary["final_checkpoint"] = final_checkpoint.name
        if self.labels is not None:
            summary["labels"] = self.labels
        (self.output / TRAINING_JSON).write_text(json.dumps(summary, indent=2) + "\n")
        self.log(f"saved {self.output} (step {self.step})")


def train(cfg: TrainConfig) -> TrainResult:
    """Train as `cfg` says; returns the final step, losses and history. The final model is in
    `cfg.output` (loadable with `longdoc.model.load_pretrained` and transformers' `from_pretrained`)."""
    return Trainer(cfg).run()
