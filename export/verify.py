"""`longdoc verify`: ONNX Runtime against the PyTorch reference on random inputs.

Reference: our PyTorch model (`longdoc.model.load_pretrained(checkpoint, plan)`), or with
`against="transformers"` transformers itself (train mode for the hf-train plan, which is what
transformers draws in training mode, built from the checkpoint's config with every dropout and
layerdrop at 0, so that the reference is deterministic whatever dropout config.json holds; eval
mode for hf-eval). The
reference always runs in fp32.

Before anything runs, the checkpoint must be the one exported: the sha256 of its weights file
must equal the manifest's `source.sha256` (`allow_other_checkpoint` turns this off: then the
comparison itself has to show that the weights differ), and its architecture and dimensions must
match the manifest's (a clear `VerifyError`, not a shape error from deep inside a graph).

Longformer exports: every check passes the same global-attention mask to both sides (the
manifest's default on the first row of some checks, 1 to 4 random positions elsewhere), at
lengths that are and are not multiples of the window. LED exports: both sides take the first
token as global (the manifest's `global_tokens` "first", what the export's summarize path passes).

Lengths the reference cannot run (outside the export's or the checkpoint's `length_bounds`) are skipped, and
the report says which and why. Checked at >= 5 lengths (the minimum, both sides of the full-attention threshold, a length that is
not a block multiple, the maximum, and transformers' special padded lengths 1024/3072/4096 with a
length that pads to each), batch 1 and batch 3 with padding (rows of S, 2S/3, S/3 real tokens),
on real positions only (padding is stripped/ignored):
  fp32  max |diff| <= 1e-4 on every output, every check;
  fp16  max |diff| <= 1e-2 x max(1, max |reference|) (fp16 keeps 11 significant bits: logits of
        magnitude 16 are rounded in steps of 0.008) and the same best spans (QA) / labels (classify) /
        tokens (MLM and decoder argmax), where a different pick counts as the same when the
        reference scores it within twice that tolerance of its own best (a tie at fp16 precision:
        seen on a GPU, where fp16 is computed as fp16, with random tiny models);
  int8  task-level agreement with the fp32 reference on the same inputs, over every row of every
        check (`Agreement`, thresholds overridable): QA best span identical in >= 90% of rows and
        the reference's best span among the int8 top 3 in all; classify label identical in >= 95%;
        MLM argmax tokens identical at >= 95% of real positions; embed: the vector's cosine with the
        reference's >= EMBED_COSINE (0.99) in >= 95% of rows; summarize: fed the reference's
        own greedy tokens, the export ranks each of the first `Agreement.tokens_prefix` (4) of them
        among its top 3 in >= 90% of rows. Identical greedy sequences are reported, not judged:
        one near tie broken the other way parts two greedy searches for good (the default
        summarizer's int8 export keeps the fp32 export's first 4 tokens on 666 of 901 real test
        pages, its first token on 829, and its ROUGE within 0.4). The deltas (max |diff|) are
        reported beside.
  summarize: decoder logits (teacher forcing) within the tolerance, and greedy and beam search
  produce the same tokens as the reference (fp32 and fp16; int8 by the agreement above).
An int8 export with int8 attention (manifest `int8_attention`) is judged by int8's agreement, and its
encoder graph must hold what the manifest says: every layer's attention products as MatMulInteger
when on, none when off.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

TOLERANCE = {"fp32": 1e-4, "fp16": 1e-2, "int8": None}
QA_TOP = 3  # int8: the reference's best span must be among the int8 model's top QA_TOP spans
GEN_TOP = 3  # int8 summarize: each of the reference's greedy tokens among the int8 model's top GEN_TOP
QA_MAX_ANSWER_TOKENS = 30
EMBED_COSINE = 0.99  # embed, int8: a row agrees when its vector's cosine with the reference's is at least this


class VerifyError(ValueError):
    """The checkpoint given cannot be compared with the export (another checkpoint, another
    architecture); the message says what differs."""


@dataclass(frozen=True)
class Agreement:
    """int8 pass criteria: fractions of rows (or MLM positions) whose answer must equal the fp32
    reference's. The defaults are documented in the module docstring and `longdoc verify --help`."""

    span: float = 0.90  # QA: best span identical
    span_in_top: float = 1.0  # QA: reference best span among the int8 top QA_TOP
    label: float = 0.95  # classify labels, MLM argmax tokens
    tokens: float = 0.90  # summarize: the reference's first `tokens_prefix` greedy tokens in the int8 top GEN_TOP
    tokens_prefix: int = 4


@dataclass
class Check:
    graph: str
    what: str
    length: int
    batch: int
    max_abs_diff: float | None
    ok: bool
    note: str = ""


@dataclass
class VerifyReport:
    model_dir: str
    dtype: str
    against: str
    checks: list[Check] = field(default_factory=list)
    skipped: dict[int, str] = field(default_factory=dict)  # length -> why it was not checked

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def summary(self) -> str:
        lines = [f"verify {self.model_dir} ({self.dtype}) against {self.against}: "
                 f"{'PASS' if self.ok else 'FAIL'} ({sum(c.ok for c in self.checks)}/{len(self.checks)} checks)"]
        lines.append(f"  {'graph':15} {'check':28} {'length':>6} {'batch':>5} {'max|diff|':>10}  result")
        for c in self.checks:
            diff = "-" if c.max_abs_diff is None else f"{c.max_abs_diff:.2e}"
            lines.append(f"  {c.graph:15} {c.what:28} {c.length:6d} {c.batch:5d} {diff:>10}  "
                         f"{'ok' if c.ok else 'MISMATCH'}{'  ' + c.note if c.note else ''}")
        lines += [f"  skipped length {n}: {why}" for n, why in self.skipped.items()]
        return "\n".join(lines)


def verify_lengths(manifest) -> list[int]:
    """min, full-attention threshold and one past it, non-multiples of block_size, max, and every
    padded length where transformers' random-block plan changes (`HF_LEGACY_LENGTHS`) with a
    length that pads to it."""
    from longdoc.model.layout import HF_LEGACY_LENGTHS

    m, bs = manifest, manifest.block_size
    fam = min(m.full_attention_max_length, m.max_length)
    candidates = [m.min_length, fam, fam + 1, fam + bs + bs // 2 + 1, (m.min_length + fam) // 2 + 1,
                  m.max_length - bs // 2 - 1, m.max_length]
    if m.attention.get("pattern") == "bigbird":
        candidates += [x for n in HF_LEGACY_LENGTHS for x in (n, n - bs // 2 - 1)]
    if m.global_tokens != "none" or any(a.get("band") for a in m.layer_attention_specs()):
        # a band (Longformer, ModernBERT's sliding layers): one block, a window (2 blocks) and around it, many windows
        candidates += [bs - 1, 2 * bs, 2 * bs + 3, 5 * bs + bs // 2 + 1]
    return sorted({x for x in candidates if m.min_length <= x <= m.max_length})


def runnable_lengths(manifest, checkpoint_dir: Path, lengths: list[int]) -> tuple[list[int], dict[int, str]]:
    """(the lengths both sides can run, {length: why not} for the others): the export runs
    min_length..max_length; the reference the bounds of the checkpoint's own export
    (`longdoc.export.exporter.length_bounds`: e.g. transformers' LED pads to a multiple of its window
    before the position table, so an export made with other bounds can hold lengths it cannot run)."""
    from longdoc.export.exporter import length_bounds, read_config

    low, high = length_bounds(read_config(checkpoint_dir))[:2]
    run, skipped = [], {}
    for n in lengths:
        if not manifest.min_length <= n <= manifest.max_length:
            skipped[n] = f"outside the export's lengths {manifest.min_length}..{manifest.max_length}"
        elif not low <= n <= high:
            skipped[n] = f"the reference runs lengths {low}..{high} of this checkpoint (docs/export.md, \"Length bounds\")"
        else:
            run.append(n)
    return run, skipped


def _random_batch(rng, manifest, vocab_size: int, S: int, batch: int):
    special = {v for v in manifest.special_tokens.values() if isinstance(v, int)}
    allowed = np.array([i for i in range(vocab_size) if i not in special])
    ids = rng.choice(allowed, size=(batch, S))
    cls, sep = manifest.special_tokens.get("cls"), manifest.special_tokens.get("sep")
    if cls is not None:
        ids[:, 0] = cls
    if sep is not None and S > 4 and manifest.task == "qa":
        ids[:, min(S // 3, 9)] = sep  # a question in front
    mask = np.ones((batch, S), np.int64)
    for row in range(1, batch):  # rows of S, 2S/3, S/3 real tokens
        real = max(1, S * (batch - row) // batch)
        mask[row, real:] = 0
        ids[row, real:] = manifest.special_tokens.get("pad") or 0
    return ids, mask


class Reference:
    """The PyTorch side, called with NumPy in and NumPy out."""

    def __init__(self, checkpoint_dir: Path, manifest, against: str):
        import torch

        self.torch, self.manifest, self.against = torch, manifest, against
        plan = manifest.attention.get("plan", "hf-train")
        if against == "model":
            from longdoc import model

            self.module = model.load_pretrained(checkpoint_dir, plan=plan)
        elif against == "transformers":
            self.module = _load_transformers(checkpoint_dir, manifest, plan)
        else:
            raise ValueError(f"against must be 'model' or 'transformers', got {against!r}")

    def _reset(self):
        if self.against == "transformers":  # transformers switches to full attention and stays
            if self.manifest.attention.get("pattern") != "bigbird":
                return
            if self.manifest.task != "summarize":
                base = self.module.base_model
            else:  # BigBirdPegasusForConditionalGeneration | EncoderDecoderModel (BigBird encoder)
                base = self.module.model.encoder if hasattr(self.module, "model") else self.module.encoder
            base.set_attention_type("block_sparse")

    def encoder(self, ids, mask, global_mask=None) -> dict[str, np.ndarray]:
        self._reset()
        t = self.torch
        extra = {} if global_mask is None else {"global_attention_mask": t.from_numpy(global_mask)}
        with t.no_grad():  # local: verify runs inside other programs (tests) that train
            out = self.module(input_ids=t.from_numpy(ids), attention_mask=t.from_numpy(mask), **extra)
        if self.manifest.task == "embed":  # the bare encoder's hidden states, pooled as sentence-transformers does
            from longdoc.export.windows import pool_tokens

            return {"embedding": pool_tokens(out.last_hidden_state.float().numpy(), mask,
                                             self.manifest.embedding["pooling"])}
        return {name: getattr(out, name).float().numpy() for name in self.manifest.outputs}

    def _summary_globals(self, ids) -> dict:
        """LED: the global tokens the export's encoder run takes by default (`default_global_mask`),
        passed explicitly (transformers' default is none)."""
        if self.manifest.global_tokens == "none":
            return {}
        from longdoc.export.runtime import default_global_mask

        return {"global_attention_mask": self.torch.from_numpy(default_global_mask(self.manifest, ids))}

    def decoder_logits(self, ids, mask, decoder_ids) -> np.ndarray:
        self._reset()
        t = self.torch
        with t.no_grad():
            out = self.module(input_ids=t.from_numpy(ids), attention_mask=t.from_numpy(mask),
                              decoder_input_ids=t.from_numpy(decoder_ids), **self._summary_globals(ids))
        return out.logits.float().numpy()

    def generate(self, ids, mask, **options) -> list[list[int]]:
        self._reset()
        t = self.torch
        with t.no_grad():
            if self.against == "transformers":
                out = self.module.generate(input_ids=t.from_numpy(ids), attention_mask=t.from_numpy(mask),
                                           do_sample=False, **self._summary_globals(ids), **options)
            else:
                out = self.module.generate(t.from_numpy(ids), t.from_numpy(mask), **self._summary_globals(ids),
                                           **options)
        return out.tolist()


def _load_transformers(checkpoint_dir: Path, manifest, plan: str):
    """transformers' model of the checkpoint, deterministic: hf-eval in eval mode; hf-train in
    training mode (where transformers draws the hf-train random blocks) with every dropout and
    layerdrop of the config at 0 before any module is built. Zeroing the built modules' Dropout is
    not enough: on an input too short for block-sparse attention BigBird rebuilds `attention.self`
    inside `forward`, with a fresh Dropout of the config's probability (0.1 in transformers'
    default config and the public checkpoints)."""
    import transformers

    if plan == "seeded":
        raise ValueError("plan 'seeded' is ours; transformers cannot reproduce it (use --against model)")
    cls = getattr(transformers, manifest.architecture)
    config = transformers.AutoConfig.from_pretrained(str(checkpoint_dir))
    if plan != "hf-eval":
        without_dropout(config)
    module = cls.from_pretrained(str(checkpoint_dir), config=config)
    return module.eval() if plan == "hf-eval" else module.train()


def without_dropout(config) -> None:
    """Set every dropout probability and layerdrop of a transformers config, and of the configs it
    holds (an EncoderDecoderConfig's encoder and decoder), to 0 in place."""
    import transformers

    for name, value in list(vars(config).items()):
        if isinstance(value, transformers.PretrainedConfig):
            without_dropout(value)
        elif ("dropout" in name or "layerdrop" in name) and isinstance(value, float):
            setattr(config, name, 0.0)


def _qa_spans(start: np.ndarray, end: np.ndarray, ids: np.ndarray, mask: np.ndarray, sep: int | None,
              top: int) -> list[tuple[int, int]]:
    """The top token spans of one row, picked by the service's span search (`longdoc.export.windows`)
    over the document part (after the first [SEP], real tokens only)."""
    from longdoc.export.windows import QAWindow, best_spans

    n = int(mask.sum())
    seps = np.flatnonzero(ids[:n] == sep) if sep is not None else np.zeros(0, np.int64)
    first = int(seps[0]) + 1 if len(seps) and seps[0] + 1 < n else 1
    window = QAWindow(tuple(int(x) for x in ids[:n]), (0,) * n, 0, n - first, first)
    offsets = [(i, i + 1) for i in range(n - first)]
    spans = best_spans([window], [start[:n]], [end[:n]], offsets, top, QA_MAX_ANSWER_TOKENS)
    return [(sp.token_start, sp.token_end) for sp in spans]


def _same_or_tie(got: np.ndarray, want: np.ndarray, tie: float) -> np.ndarray:
    """Per row of (..., V) scores: the argmax of `got` is the reference's, or the reference scores
    it within `tie` of its best (0: exact agreement only)."""
    pick = got.argmax(-1)
    picked = np.take_along_axis(want, pick[..., None], axis=-1)[..., 0]
    return (pick == want.argmax(-1)) | (picked >= want.max(-1) - tie)


def _span_same_or_tie(mine: list, theirs: list, ref_start: np.ndarray, ref_end: np.ndarray, ids: np.ndarray,
                      sep, tie: float) -> bool:
    """QA: the best span is the reference's, or the reference scores it within `tie` of its best."""
    if mine[:1] == theirs[:1]:
        return True
    if not mine or not theirs or not tie:
        return False
    seps = np.flatnonzero(ids == sep) if sep is not None else np.zeros(0, np.int64)
    first = int(seps[0]) + 1 if len(seps) else 1

    def score(span):
        return float(ref_start[first + span[0]] + ref_end[first + span[1]])

    return score(mine[0]) >= score(theirs[0]) - tie


def _answers(task: str, outputs: dict[str, np.ndarray], ids, mask, sep) -> list:
    """The task-level answer of every row: QA top spans, a label, or the MLM argmax tokens."""
    if task == "qa":
        return [_qa_spans(outputs["start_logits"][b], outputs["end_logits"][b], ids[b], mask[b], sep, QA_TOP)
                for b in range(len(ids))]
    if task == "classify":
        return [int(x) for x in outputs["logits"].argmax(-1)]
    if task == "embed":  # the direction (cosine similarity is what users compare)
        e = outputs["embedding"].astype(np.float64)
        return list(e / np.maximum(np.linalg.norm(e, axis=-1, keepdims=True), 1e-12))
    return [outputs["logits"][b].argmax(-1)[mask[b].astype(bool)] for b in range(len(ids))]  # mlm


def random_global_mask(rng, manifest, ids: np.ndarray, mask: np.ndarray, row_default: bool) -> np.ndarray:
    """(B, S) int64 global-attention mask for a Longformer check: the manifest's default on row 0 when
    `row_default` (and the row has what it needs), elsewhere 1 to 4 random real positions."""
    from longdoc.export.runtime import default_global_mask

    out = np.zeros(ids.shape, np.int64)
    for b in range(len(ids)):
        real = np.flatnonzero(mask[b])
        if b == 0 and row_default and (manifest.global_tokens != "question"
                                       or (ids[b] == manifest.special_tokens.get("sep")).any()):
            out[b] = default_global_mask(manifest, ids[b:b + 1])[0]
        else:
            out[b, rng.choice(real, size=min(len(real), int(rng.integers(1, 5))), replace=False)] = 1
    return out


def check_checkpoint(manifest, checkpoint_dir: Path, allow_other_checkpoint: bool = False) -> None:
    """Raise VerifyError unless `checkpoint_dir` holds what was exported (sha256 of the weights,
    unless allowed otherwise) with the manifest's architecture and dimensions."""
    from longdoc.export.exporter import (CheckpointError, encoder_block_size, encoder_config, read_config, task_of,
                                         weights_path)
    from longdoc.export.manifest import sha256_of

    try:
        config = read_config(checkpoint_dir)
        task_of(config, manifest.task)
        weights = weights_path(checkpoint_dir)
        block_size = encoder_block_size(config)
    except CheckpointError as exc:
        raise VerifyError(f"{checkpoint_dir} cannot be compared with {manifest.task!r} model: {exc}") from None
    arch = (config.get("architectures") or [manifest.architecture])[0]
    if arch != manifest.architecture:
        raise VerifyError(f"{checkpoint_dir} is a {arch}, but the export is a {manifest.architecture}")
    enc = encoder_config(config)  # under BERT's names, whatever the architecture
    dims = {"hidden_size": enc.get("hidden_size"), "num_layers": enc.get("num_hidden_layers"),
            "num_heads": enc.get("num_attention_heads"), "block_size": block_size}
    differ = [f"{k} {v} (export: {getattr(manifest, k)})" for k, v in dims.items() if v != getattr(manifest, k)]
    if manifest.labels is not None and len(config.get("id2label") or {}) not in (0, len(manifest.labels)):
        differ.append(f"{len(config['id2label'])} labels (export: {len(manifest.labels)})")
    if differ:
        raise VerifyError(f"{checkpoint_dir} has another shape than the export: {', '.join(differ)}")
    want = manifest.source.get("sha256")
    if want and not allow_other_checkpoint:
        got = sha256_of(weights)
        if got != want:
            raise VerifyError(f"{weights} is not the checkpoint this model was exported from (sha256 {got[:12]}..., "
                              f"the manifest records {want[:12]}... from {manifest.source.get('checkpoint')}); "
                              "pass --allow-other-checkpoint to compare anyway")


def special_token_mismatches_of(manifest, checkpoint_dir: Path, tokenizer) -> list[str]:
    """`longdoc.model.tokenization.special_token_mismatches` of the checkpoint's config against
    its tokenizer files (the export's tokenizer.json for the vocabulary), for the ids its
    architecture reads (the registry record's `config_token_ids`)."""
    from longdoc.export.exporter import lowering_of, read_config
    from longdoc.model.tokenization import special_token_mismatches

    config = read_config(checkpoint_dir)
    record = lowering_of(config).model
    return special_token_mismatches(checkpoint_dir, tokenizer, config,
                                    record.config_token_ids.get(manifest.task, ()), manifest.architecture)


def verify_model(model_dir, checkpoint_dir, against: str = "model", lengths: list[int] | None = None,
                 progress: Callable[[str], None] = print, seed: int = 0, threads: int | None = None,
                 generation_lengths: int = 2, max_new_tokens: int = 8, agreement: Agreement = Agreement(),
                 allow_other_checkpoint: bool = False, device: str = "cpu") -> VerifyReport:
    """device: where ONNX Runtime runs the export ("cpu", "cuda", "cuda:N"); the PyTorch reference
    runs on the CPU in fp32 either way."""
    from longdoc.export.runtime import OnnxModel, parse_device

    model_dir, checkpoint_dir = Path(model_dir), Path(checkpoint_dir)
    kind, device_id = parse_device(device)
    onnx_model = OnnxModel(model_dir, device=kind, threads=threads, device_id=device_id)
    m = onnx_model.manifest
    checkpoint_dir = _reference_checkpoint(model_dir, checkpoint_dir, m)
    check_checkpoint(m, checkpoint_dir, allow_other_checkpoint)
    progress(f"loading the {against} reference from {checkpoint_dir}")
    ref = Reference(checkpoint_dir, m, against)
    tol = TOLERANCE[m.dtype]
    dtype = m.dtype if m.int8_attention == "off" else f"{m.dtype}, int8 attention {m.int8_attention}"
    report = VerifyReport(str(model_dir), dtype, against)
    rng = np.random.default_rng(seed)
    vocab = onnx_model.tokenizer.get_vocab_size()
    lengths, report.skipped = runnable_lengths(m, checkpoint_dir, lengths or verify_lengths(m))
    for n, why in report.skipped.items():
        progress(f"skipping length {n}: {why}")
    if not lengths:
        raise VerifyError(f"no length to check: {'; '.join(f'{n}: {why}' for n, why in report.skipped.items())}")
    agree: dict[str, list[bool]] = {}  # int8 criterion -> one bool per row (MLM: per position)

    def record(graph, what, S, B, diff, ok, note=""):
        check = Check(graph, what, S, B, diff, ok, note)
        report.checks.append(check)
        shown = "-" if diff is None else f"{diff:.2e}"
        progress(f"[{graph}] {what} length {S} batch {B}: max|diff| {shown} {'ok' if ok else 'MISMATCH'} {note}")

    # whatever the dtype: a config whose special-token ids are not its tokenizer's computes another
    # model than the export (an int8 export's looser criteria can pass where fp32 fails on it)
    if mismatches := special_token_mismatches_of(m, checkpoint_dir, onnx_model.tokenizer):
        record("config", "special-token ids", 0, 0, None, False, "; ".join(mismatches))
    if m.dtype == "int8":
        record("encoder", "int8 attention products", 0, 0, None, *_int8_attention_matches(model_dir, m))
    for S in lengths:
        for B in (1, 3):
            ids, mask = _random_batch(rng, m, vocab, S, B)
            if m.task == "summarize":
                _check_decoder_logits(onnx_model, ref, rng, vocab, ids, mask, record)
            else:
                _check_encoder(onnx_model, ref, rng, ids, mask, agree, record)
    if m.task == "summarize":
        for S in sorted({lengths[0], lengths[-1]})[:generation_lengths]:
            _check_generation(onnx_model, ref, *_random_batch(rng, m, vocab, S, 2), max_new_tokens, agreement,
                              agree, record)
    if m.dtype == "int8":
        _judge_agreement(agree, agreement, record)
    return report


def _reference_checkpoint(model_dir: Path, checkpoint_dir: Path, m) -> Path:
    """The checkpoint to compare the export with (an embed export's: its sentence-transformers
    folder's Transformer module); refuses an export that has no reference."""
    if m.task == "embed":  # a sentence-transformers folder: the checkpoint is its Transformer module
        from longdoc.export.exporter import CheckpointError, sentence_embedding

        try:
            checkpoint_dir = sentence_embedding(checkpoint_dir).checkpoint_dir
        except CheckpointError as exc:
            raise VerifyError(str(exc)) from None
    if m.architecture.startswith("Longformer") and m.attention.get("pattern") == "dense":
        raise VerifyError(f"{model_dir} is a full-attention Longformer export (longdoc export --attention full), a "
                          "benchmark baseline: it computes what the checkpoint computes only when the window covers "
                          "the whole input, so there is no reference to verify it against")
    return checkpoint_dir


def _check_decoder_logits(onnx_model, ref, rng, vocab: int, ids, mask, record) -> None:
    """One decoder step of 5 random tokens after the encoder, against the reference's logits."""
    m = onnx_model.manifest
    B, S = ids.shape
    tol = TOLERANCE[m.dtype]
    dec = rng.integers(0, vocab, (B, 5))
    dec[:, 0] = m.special_tokens["decoder_start"]
    state = onnx_model.encode_for_decoding(ids, mask)
    got, _ = onnx_model.decoder_step(state, dec, np.broadcast_to(np.arange(5), (B, 5)),
                                     np.ones((B, 5), np.int64), onnx_model.empty_past(B))
    want = ref.decoder_logits(ids, mask, dec)
    diff = float(np.abs(got - want).max())
    row_tol = _scaled(tol, want, m.dtype)
    same = bool(_same_or_tie(got, want, 2 * row_tol if m.dtype == "fp16" else 0.0).all())
    ok = m.dtype == "int8" or (diff <= row_tol and (m.dtype == "fp32" or same))
    record("encoder+decoder", "decoder logits", S, B, diff, ok,
           ("" if same else "argmax differs") + (" (int8: judged on generated tokens)" if m.dtype == "int8" else ""))


def _check_encoder(onnx_model, ref, rng, ids, mask, agree: dict[str, list[bool]], record) -> None:
    """The encoder's outputs against the reference's (Longformer: the same random global tokens on
    both sides); the answers they give (span, label, token, embedding) voted into `agree`."""
    m = onnx_model.manifest
    B, S = ids.shape
    tol, sep = TOLERANCE[m.dtype], m.special_tokens.get("sep")
    global_mask = None
    if m.global_tokens != "none":  # Longformer: the same global tokens on both sides
        global_mask = random_global_mask(rng, m, ids, mask, row_default=B == 1 or S % 2 == 0)
    got = onnx_model.run_encoder(ids, mask, global_attention_mask=global_mask)
    want = ref.encoder(ids, mask, global_mask)
    if any(got[n].shape != want[n].shape for n in m.outputs):
        for n in m.outputs:
            record("encoder", n, S, B, None, got[n].shape == want[n].shape, f"shape {got[n].shape} vs {want[n].shape}")
        return
    mine, theirs = _answers(m.task, got, ids, mask, sep), _answers(m.task, want, ids, mask, sep)
    diffs, tols = {}, {}
    for name in m.outputs:
        g, w = got[name], want[name]
        if m.task in ("classify", "embed"):  # one row per sequence
            sel = np.ones(w.shape, bool)
        else:  # real positions only; QA question tokens sit near -1e6 in both (fp32 ulp ~0.06)
            keep = mask.astype(bool)
            sel = keep & (np.abs(w) < 1e5) if m.task == "qa" else keep
        diffs[name] = float(np.abs(g[sel] - w[sel]).max()) if sel.any() else 0.0
        tols[name] = _scaled(tol, w[sel], m.dtype)
    tie = 2 * max(tols.values()) if m.dtype == "fp16" else 0.0
    if m.task == "qa":
        agree.setdefault("best span identical", []).extend(a[:1] == b[:1] for a, b in zip(mine, theirs))
        agree.setdefault(f"reference span in top {QA_TOP}", []).extend(b[0] in a for a, b in zip(mine, theirs) if b)
        same = all(_span_same_or_tie(a, b, want["start_logits"][i], want["end_logits"][i], ids[i], sep, tie)
                   for i, (a, b) in enumerate(zip(mine, theirs)))
    elif m.task == "classify":
        agree.setdefault("label identical", []).extend(a == b for a, b in zip(mine, theirs))
        same = bool(_same_or_tie(got["logits"], want["logits"], tie).all())
    elif m.task == "embed":
        cosines = [float(a @ b) for a, b in zip(mine, theirs)]
        agree.setdefault(f"cosine >= {EMBED_COSINE}", []).extend(c >= EMBED_COSINE for c in cosines)
        same = min(cosines) >= EMBED_COSINE
    else:
        flat = np.concatenate([a == b for a, b in zip(mine, theirs)])
        agree.setdefault("argmax token identical", []).extend(flat.tolist())
        same = bool(_same_or_tie(got["logits"], want["logits"], tie)[mask.astype(bool)].all())
    for name in m.outputs:
        if m.dtype == "int8":
            ok, note = True, ("best unchanged" if same else "best changed") + " (int8: judged by agreement)"
        else:
            ok = diffs[name] <= tols[name] and (m.dtype == "fp32" or same)
            note = "" if same else "best span/label differs"
        record("encoder", name, S, B, diffs[name], ok, note)


def _check_generation(onnx_model, ref, ids, mask, max_new_tokens: int, agreement: Agreement,
                      agree: dict[str, list[bool]], record) -> None:
    """Greedy and 3-beam generation against the reference's tokens (int8: voted into `agree`)."""
    m = onnx_model.manifest
    B, S = ids.shape
    for beams in (1, 3):
        options = dict(max_new_tokens=max_new_tokens, num_beams=beams, no_repeat_ngram_size=0)
        got = onnx_model.generate(ids, mask, **options)
        want = ref.generate(ids, mask, **options)
        fill = (m.special_tokens.get("pad"), m.special_tokens.get("eos"))
        rows_same = [list(w[: len(g)]) == g and all(t in fill for t in w[len(g):]) for g, w in zip(got, want)]
        if beams == 1 and m.dtype == "int8":
            n = agreement.tokens_prefix
            agree.setdefault(f"first {n} greedy tokens identical", []).extend(
                same_greedy_prefix(g, w, n, fill[1]) for g, w in zip(got, want))
            agree.setdefault(f"reference's first {n} tokens in int8 top {GEN_TOP}", []).extend(
                reference_tokens_in_top(onnx_model, ids, mask, want, n, GEN_TOP, fill[1]))
        same = all(rows_same)
        ok = same or m.dtype == "int8"
        what = "greedy tokens" if beams == 1 else f"beam({beams}) tokens"
        bad = rows_same.index(False) if not same else 0
        record("generate", what, S, B, None, ok,
               "identical" if same else f"row {bad} differs: {got[bad][:8]} vs {list(want[bad][:8])}"
               + (" (int8: judged by agreement)" if m.dtype == "int8" else ""))


def _judge_agreement(agree: dict[str, list[bool]], agreement: Agreement, record) -> None:
    """An int8 export passes by how often its answers agree with the reference's."""
    need = {"best span identical": agreement.span, f"reference span in top {QA_TOP}": agreement.span_in_top,
            "label identical": agreement.label, "argmax token identical": agreement.label,
            f"cosine >= {EMBED_COSINE}": agreement.label,
            f"reference's first {agreement.tokens_prefix} tokens in int8 top {GEN_TOP}": agreement.tokens}
    for what, votes in agree.items():
        share = sum(votes) / max(len(votes), 1)
        if what not in need:  # reported, not judged (identical greedy sequences: see the module docstring)
            record("agreement", what, 0, 0, None, True, f"{sum(votes)}/{len(votes)} = {100 * share:.1f}% (reported)")
            continue
        record("agreement", what, 0, 0, None, share >= need[what],
               f"{sum(votes)}/{len(votes)} = {100 * share:.1f}% (need >= {100 * need[what]:.0f}%)")


def _int8_attention_matches(model_dir: Path, m) -> tuple[bool, str]:
    """(the encoder's attention MatMulIntegers agree with the manifest's int8_attention, what was found)"""
    import onnx

    from longdoc.export.census import attention_int8_matmuls

    graph = onnx.load(str(m.path_of(model_dir, m.graphs["encoder"])), load_external_data=False)
    found = attention_int8_matmuls(graph)
    layers = sum(found[scope] >= 2 for scope in found)
    if m.int8_attention == "off":
        return not found, f"manifest: off; {sum(found.values())} attention MatMulInteger node(s) in the graph"
    # a band layer (ModernBERT's sliding layers) keeps its products fp32: the other layers run them in int8
    expected = sum(not spec.get("band") for spec in m.layer_attention_specs())
    return layers == expected, (f"manifest: {m.int8_attention}; {layers}/{expected} layers without a band run both "
                                f"products as MatMulInteger")


def _scaled(tol: float | None, reference: np.ndarray, dtype: str) -> float | None:
    """fp16's tolerance grows with the reference's magnitude (a relative precision); fp32's is absolute."""
    if dtype != "fp16" or tol is None or not reference.size:
        return tol
    return tol * max(1.0, float(np.abs(reference).max()))


def reference_tokens_in_top(onnx_model, ids, mask, want, n: int, k: int, eos) -> list[bool]:
    """Per row: fed the reference's own greedy tokens (teacher forcing), does the export rank each
    of the reference's first n generated tokens (up to its eos) among its top k? A faithful int8
    export can break a near tie the other way, after which two greedy searches part for good; an
    export of other weights, or a broken one, ranks the reference's tokens anywhere."""
    rows = [_pad(list(w[1:]), n, eos) for w in want]  # generated tokens (after the start), -1 after eos
    start = [int(w[0]) for w in want]
    feed = np.array([[s] + [t if t >= 0 else eos for t in r[:-1]] for s, r in zip(start, rows)], np.int64)
    B = len(rows)
    state = onnx_model.encode_for_decoding(ids, mask)
    logits, _ = onnx_model.decoder_step(state, feed, np.broadcast_to(np.arange(n), (B, n)), np.ones((B, n), np.int64),
                                        onnx_model.empty_past(B))
    out = []
    for b, r in enumerate(rows):
        steps = [t for t in range(n) if r[t] >= 0]
        out.append(all(int((logits[b, t] > logits[b, t, r[t]]).sum()) < k for t in steps))
    return out


def same_greedy_prefix(got, want, n: int, eos) -> bool:
    """Two generated rows (each starting with the decoder start token) agree on their first n
    generated tokens, up to an eos. The start token is left out: LED's (and BART's) is the eos
    itself, and cut there every row compared as identical."""
    return _pad(list(got[1:]), n, eos) == _pad(list(want[1:]), n, eos)


def _pad(tokens, n: int, eos) -> list:
    """The first n tokens, cut after the first eos and padded with -1 (ended is ended, whatever
    filler follows)."""
    out = []
    for t in tokens[:n]:
        out.append(int(t))
        if t == eos:
            break
    return out + [-1] * (n - len(out))
