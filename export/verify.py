"""`longdoc verify`: ONNX Runtime against the PyTorch reference on random inputs.

Reference: our PyTorch model (`model.load_pretrained(checkpoint, plan)`), or with
`against="transformers"` transformers itself (train mode with every dropout at 0 for the
hf-train plan, which is what transformers draws in training mode; eval mode for hf-eval).

Checked at >= 5 lengths (the minimum, both sides of the full-attention threshold, a length that is
not a block multiple, the maximum), batch 1 and batch 3 with padding (rows of S, 2S/3, S/3 real
tokens), on real positions only (padding is stripped/ignored):
  fp32  max |diff| <= 1e-4 on the logits;
  fp16  max |diff| <= 1e-2 and identical best spans (QA) / labels (classify) / tokens (MLM argmax);
  int8  deltas reported, best spans / labels agreement reported (not a failure);
  summarize: decoder logits (teacher forcing) within the tolerance, and greedy and beam search
  produce the same tokens as the reference (fp32; reported for fp16/int8).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

TOLERANCE = {"fp32": 1e-4, "fp16": 1e-2, "int8": None}


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
        return "\n".join(lines)


def verify_lengths(manifest) -> list[int]:
    """min, full-attention threshold and one past it, non-multiples of block_size, max, and every
    padded length where transformers' random-block plan changes (`HF_LEGACY_LENGTHS`) with a
    length that pads to it."""
    from model.layout import HF_LEGACY_LENGTHS

    m, bs = manifest, manifest.block_size
    fam = min(m.full_attention_max_length, m.max_length)
    candidates = [m.min_length, fam, fam + 1, fam + bs + bs // 2 + 1, (m.min_length + fam) // 2 + 1,
                  m.max_length - bs // 2 - 1, m.max_length]
    if m.attention.get("pattern") == "bigbird":
        candidates += [x for n in HF_LEGACY_LENGTHS for x in (n, n - bs // 2 - 1)]
    return sorted({x for x in candidates if m.min_length <= x <= m.max_length})


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
            import model

            self.module = model.load_pretrained(checkpoint_dir, plan=plan)
        elif against == "transformers":
            self.module = _load_transformers(checkpoint_dir, manifest, plan)
        else:
            raise ValueError(f"against must be 'model' or 'transformers', got {against!r}")

    def _reset(self):
        if self.against == "transformers":  # transformers switches to full attention and stays
            base = self.module.model.encoder if self.manifest.task == "summarize" else self.module.base_model
            if self.manifest.attention.get("pattern") != "dense":
                base.set_attention_type("block_sparse")

    def encoder(self, ids, mask) -> dict[str, np.ndarray]:
        self._reset()
        t = self.torch
        with t.no_grad():  # local: verify runs inside other programs (tests) that train
            out = self.module(input_ids=t.from_numpy(ids), attention_mask=t.from_numpy(mask))
        return {name: getattr(out, name).float().numpy() for name in self.manifest.outputs}

    def decoder_logits(self, ids, mask, decoder_ids) -> np.ndarray:
        self._reset()
        t = self.torch
        with t.no_grad():
            out = self.module(input_ids=t.from_numpy(ids), attention_mask=t.from_numpy(mask),
                              decoder_input_ids=t.from_numpy(decoder_ids))
        return out.logits.float().numpy()

    def generate(self, ids, mask, **options) -> list[list[int]]:
        self._reset()
        t = self.torch
        with t.no_grad():
            if self.against == "transformers":
                out = self.module.generate(input_ids=t.from_numpy(ids), attention_mask=t.from_numpy(mask),
                                           do_sample=False, **options)
            else:
                out = self.module.generate(t.from_numpy(ids), t.from_numpy(mask), **options)
        return out.tolist()


def _load_transformers(checkpoint_dir: Path, manifest, plan: str):
    import transformers

    if plan == "seeded":
        raise ValueError("plan 'seeded' is ours; transformers cannot reproduce it (use --against model)")
    cls = getattr(transformers, manifest.architecture)
    module = cls.from_pretrained(str(checkpoint_dir))
    if plan == "hf-eval":
        return module.eval()
    module.train()  # transformers draws the hf-train blocks in training mode; switch dropout off
    for sub in module.modules():
        if sub.__class__.__name__ == "Dropout":
            sub.p = 0.0
        for attr in ("dropout", "activation_dropout", "attention_dropout"):
            if isinstance(getattr(sub, attr, None), float):
                setattr(sub, attr, 0.0)
    return module


def _best(task: str, name: str, value: np.ndarray, mask: np.ndarray):
    """Best span ends / labels / MLM tokens, for agreement checks."""
    if task == "classify":
        return value.argmax(-1)
    if task == "qa":
        return np.where(mask.astype(bool), value, -np.inf).argmax(-1)
    return value.argmax(-1)[mask.astype(bool)]  # mlm


def verify_model(model_dir, checkpoint_dir, against: str = "model", lengths: list[int] | None = None,
                 progress: Callable[[str], None] = print, seed: int = 0, threads: int | None = None,
                 generation_lengths: int = 2, max_new_tokens: int = 8) -> VerifyReport:
    from export.exporter import read_config
    from export.runtime import OnnxModel

    model_dir, checkpoint_dir = Path(model_dir), Path(checkpoint_dir)
    read_config(checkpoint_dir)  # fail fast on a bad checkpoint directory
    onnx_model = OnnxModel(model_dir, threads=threads)
    m = onnx_model.manifest
    progress(f"loading the {against} reference from {checkpoint_dir}")
    ref = Reference(checkpoint_dir, m, against)
    tol = TOLERANCE[m.dtype]
    report = VerifyReport(str(model_dir), m.dtype, against)
    rng = np.random.default_rng(seed)
    vocab = onnx_model.tokenizer.get_vocab_size()
    lengths = lengths or verify_lengths(m)

    def record(graph, what, S, B, diff, ok, note=""):
        check = Check(graph, what, S, B, diff, ok, note)
        report.checks.append(check)
        shown = "-" if diff is None else f"{diff:.2e}"
        progress(f"[{graph}] {what} length {S} batch {B}: max|diff| {shown} {'ok' if ok else 'MISMATCH'} {note}")

    for S in lengths:
        for B in (1, 3):
            ids, mask = _random_batch(rng, m, vocab, S, B)
            if m.task == "summarize":
                dec = rng.integers(0, vocab, (B, 5))
                dec[:, 0] = m.special_tokens.get("decoder_start") or 0
                state = onnx_model.encode_for_decoding(ids, mask)
                got, _ = onnx_model.decoder_step(state, dec, np.broadcast_to(np.arange(5), (B, 5)),
                                                 np.ones((B, 5), np.int64), onnx_model.empty_past(B))
                want = ref.decoder_logits(ids, mask, dec)
                diff = float(np.abs(got - want).max())
                same = bool((got.argmax(-1) == want.argmax(-1)).all())
                ok = (tol is None or diff <= tol) and (m.dtype == "int8" or m.dtype == "fp32" or same)
                record("encoder+decoder", "decoder logits", S, B, diff, ok,
                       "" if same else "argmax differs" + (" (int8: reported)" if m.dtype == "int8" else ""))
                continue
            got = onnx_model.run_encoder(ids, mask)
            want = ref.encoder(ids, mask)
            for name in m.outputs:
                g, w = got[name], want[name]
                if g.shape != w.shape:
                    record("encoder", name, S, B, None, False, f"shape {g.shape} != {w.shape}")
                    continue
                if m.task == "classify":
                    diff = float(np.abs(g - w).max())
                else:  # real positions only; QA question tokens sit near -1e6 in both (fp32 ulp ~0.06)
                    keep = mask.astype(bool)
                    sel = keep & (np.abs(w) < 1e5) if m.task == "qa" else keep
                    diff = float(np.abs(g[sel] - w[sel]).max()) if sel.any() else 0.0
                same = bool(np.array_equal(_best(m.task, name, g, mask), _best(m.task, name, w, mask)))
                if m.dtype == "int8":
                    ok, note = True, ("best unchanged" if same else "best CHANGED") + " (int8: reported)"
                else:
                    ok = diff <= tol and (m.dtype == "fp32" or same)
                    note = "" if same else "best span/label differs"
                record("encoder", name, S, B, diff, ok, note)

    if m.task == "summarize":
        gen_lengths = sorted({lengths[0], lengths[-1]})[:generation_lengths]
        for S in gen_lengths:
            ids, mask = _random_batch(rng, m, vocab, S, 2)
            for beams in (1, 3):
                options = dict(max_new_tokens=max_new_tokens, num_beams=beams, no_repeat_ngram_size=0)
                got = onnx_model.generate(ids, mask, **options)
                want = ref.generate(ids, mask, **options)
                fill = (m.special_tokens.get("pad"), m.special_tokens.get("eos"))
                rows_same = [list(w[: len(g)]) == g and all(t in fill for t in w[len(g):]) for g, w in zip(got, want)]
                same = all(rows_same)
                ok = same or m.dtype != "fp32"
                what = "greedy tokens" if beams == 1 else f"beam({beams}) tokens"
                bad = rows_same.index(False) if not same else 0
                record("generate", what, S, 2, None, ok,
                       "identical" if same else f"row {bad} differs: {got[bad][:8]} vs {list(want[bad][:8])}"
                       + ("" if m.dtype == "fp32" else f" ({m.dtype}: reported)"))
    return report
