"""The fake worker: deterministic "models" over a tiny word-level tokenizer, behind the same seam
as `longdoc.service.workers.OnnxWorker` (info, health, warmup, run, begin/step/release, generate),
so the API, the batcher and the host pool are testable without a model. NumPy and tokenizers
only: no torch, no ONNX session."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import numpy as np
from tokenizers import Tokenizer

from longdoc.export.generation import generated_tokens
from longdoc.model.search import SearchSettings, StepConstraints, beam_search, constrained_argmax, greedy_search
from longdoc.service.workers import EncoderBatch, ModelInfo


FAKE_SPECIALS = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4, "eos": 5, "bos": 6, "decoder_start": 0}
FAKE_GENERATION = {"eos_token_id": 5, "pad_token_id": 0, "decoder_start_token_id": 0}
FAKE_WORDS = ("gold", "good", "bad", "the", "is", "where", "what", "a", "of", "and", "answer")


def fake_tokenizer(extra_words: int = 200) -> Tokenizer:
    from tokenizers import models, normalizers, pre_tokenizers

    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4, "</s>": 5, "<s>": 6}
    for w in (*FAKE_WORDS, *(f"w{i}" for i in range(extra_words))):
        vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


class FakeWorker:
    """qa: start and end logits peak on the token "gold"; classify: logits = counts of "bad" and
    "good" per window (labels bad, good); embed: per window, the share of its tokens that are each
    of FAKE_WORDS (a vector of len(FAKE_WORDS), normalized by the service); summarize: copies the
    document's first tokens, then eos. `delay_s` sleeps per run/step; `fail_runs` makes that many
    runs raise."""

    overlaps_encoding = False

    def __init__(self, name: str = "fake", task: str = "qa", max_length: int = 64, block_size: int = 8,
                 delay_s: float = 0.0, fail_runs: int = 0, summary_tokens: int = 6, max_batch_tokens: int = 4096):
        self.device = "cpu"
        self.tokenizer = fake_tokenizer()
        self.info = ModelInfo(
            name=name, task=task, max_length=max_length, block_size=block_size, tokenizer=self.tokenizer,
            special_tokens=dict(FAKE_SPECIALS), labels=("bad", "good") if task == "classify" else None,
            plan="hf-eval", max_new_tokens=64, generation=dict(FAKE_GENERATION),
            embedding={"pooling": "mean", "normalize": True} if task == "embed" else None,
            hidden_size=len(FAKE_WORDS),
        )
        self.max_batch_tokens = max_batch_tokens
        self.delay_s = delay_s
        self.fail_runs = fail_runs
        self.summary_tokens = summary_tokens
        self.vocab_size = self.tokenizer.get_vocab_size()
        self.batches: list[tuple[int, int]] = []  # (batch size, padded length) per run
        self.steps: list[int] = []  # requests per decoder step
        self._lock = threading.Lock()
        self._healthy = True
        self.closed = False

    def health(self) -> bool:
        return self._healthy

    def warmup(self) -> None:
        n = self.info.max_length
        self.run(EncoderBatch(np.ones((1, n), np.int64), np.ones((1, n), np.int64), None))
        self.batches.clear()

    def _maybe_fail(self) -> None:
        with self._lock:
            if self.fail_runs > 0:
                self.fail_runs -= 1
                self._healthy = False
                raise RuntimeError("fake worker failure")

    def run(self, batch: EncoderBatch) -> dict[str, np.ndarray]:
        self._maybe_fail()
        if self.delay_s:  # slow on purpose: the time a model would take, which the tests ask for
            time.sleep(self.delay_s)
        ids = batch.input_ids
        assert ids.shape[1] <= self.info.max_length, ids.shape
        self.batches.append(ids.shape)
        vocab = self.tokenizer.get_vocab()
        if self.info.task == "qa":
            hit = (ids == vocab["gold"]).astype(np.float32) * 10.0
            return {"start_logits": hit, "end_logits": hit.copy()}
        if self.info.task == "embed":  # mean "pooling" over the real tokens of each row
            real = batch.attention_mask.astype(np.float32)
            counts = np.stack([((ids == vocab[w]) * real).sum(axis=1) for w in FAKE_WORDS], axis=1)
            return {"embedding": (counts / real.sum(axis=1, keepdims=True)).astype(np.float32)}
        bad = (ids == vocab["bad"]).sum(axis=1)
        good = (ids == vocab["good"]).sum(axis=1)
        return {"logits": np.stack([bad, good], axis=1).astype(np.float32)}

    def begin(self, input_ids: list[list[int]]) -> list[Any]:
        self._maybe_fail()
        return [{"source": list(ids), "length": 0} for ids in input_ids]

    def step(self, states: list[Any], tokens: list[int]) -> np.ndarray:
        self.steps.append(len(states))
        return self._next_logits(states)

    def step_greedy(self, states: list[Any], tokens: list[int], constraints: list[StepConstraints]) -> list[int]:
        return [constrained_argmax(row, c) for row, c in zip(self.step(states, tokens), constraints)]

    def release(self) -> None:
        pass

    def _next_logits(self, states: list[Any]) -> np.ndarray:
        if self.delay_s:  # slow on purpose, as in run
            time.sleep(self.delay_s)
        logits = np.zeros((len(states), self.vocab_size), np.float32)
        for i, s in enumerate(states):
            source = [t for t in s["source"] if t > FAKE_SPECIALS["bos"]]
            n = s["length"]
            nxt = source[n] if n < min(len(source), self.summary_tokens) else FAKE_SPECIALS["eos"]
            logits[i, nxt] = 1.0
            s["length"] += 1
        return logits

    def generate(self, input_ids: list[int], settings: SearchSettings,
                 should_stop: Callable[[], bool] | None = None) -> list[int]:
        """model/search.py over the decoder steps: the next token depends only on the position,
        so beams need no reordering."""
        states = self.begin([input_ids] * settings.num_beams)

        def next_logits(sequences: np.ndarray) -> np.ndarray:
            self.steps.append(1)  # one request, however many beams
            return self._next_logits(states)

        if settings.num_beams == 1:
            out = greedy_search(next_logits, 1, settings, should_stop)
        else:
            out = beam_search(next_logits, lambda rows: None, 1, settings, should_stop)
        return generated_tokens(out[0].tolist(), settings)

    def close(self) -> None:
        self.closed = True
