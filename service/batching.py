"""The batching policy: which queued sequences run together next. Pure and synchronous (no
asyncio, no clock of its own: callers pass `now`), so it is tested on its own; the batcher task in
`service/batcher.py` is its only owner.

Rules, in order:
- Every sequence is charged its *bucket* length: its token count rounded up to the bucket size
  (the model's block size), because the encoder pads to a block multiple anyway. A batch only holds
  sequences of one bucket, so short documents are never padded to long ones, and the padded cost
  of a batch is `bucket_length * count` exactly.
- A batch never costs more than the token budget nor holds more than `max_batch_size` sequences.
  The one exception is a single sequence whose bucket alone exceeds the budget: it runs alone
  (refusing it would starve it; the caller bounds sequence length separately).
- Fairness across buckets: once the oldest queued sequence has waited `max_wait_s`, the next
  batch is taken from the bucket of a *head* sequence and starts with it. Before that, a bucket
  that can fill a whole batch may go first.
- Fairness between requests (an entry's `owner`): the head alternates between the oldest
  sequence (FIFO) and the oldest sequence of the request served the fewest tokens so far. So a
  small request queued behind a large one runs its windows every other batch instead of after
  all of the large one's, and the large one still gets at least every other batch. Entries
  without an owner share one (plain FIFO).
- Cancelled sequences (client gone, deadline passed) are dropped when met and handed back through
  `drop_cancelled`, never batched.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(eq=False)
class Entry:
    """One queued sequence. `payload` is the caller's (e.g. a future); the policy never reads it."""

    length: int  # tokens, before padding
    arrival: float  # seconds, the caller's clock
    payload: Any = None
    is_cancelled: Callable[[], bool] = field(default=lambda: False, repr=False)
    owner: Any = None  # the request it belongs to (fairness between requests)
    seq: int = -1  # arrival order, set by append


@dataclass(frozen=True)
class Batch:
    entries: tuple[Entry, ...]
    bucket_length: int  # every entry is padded to this

    @property
    def padded_tokens(self) -> int:
        return self.bucket_length * len(self.entries)

    @property
    def real_tokens(self) -> int:
        return sum(e.length for e in self.entries)


def bucket_length(length: int, bucket_size: int) -> int:
    """A sequence's padded length: its token count rounded up to the bucket size (at least one)."""
    return max(1, -(-length // bucket_size)) * bucket_size


def budget_groups(lengths: list[int], max_batch_tokens: int, bucket_size: int) -> list[list[int]]:
    """The decode scheduler's newcomers as encoder batches (`OnnxWorker.begin`), by this module's
    rules: a group holds sequences of one bucket, so that each is padded to the length it has
    alone (a short document padded to a long one's length would run the long one's attention:
    block-sparse past the full-attention length, a layout of more blocks, another summary), and
    costs at most `max_batch_tokens` (its bucket length times its count); a sequence over the
    budget alone runs alone. Each group is the indices of its sequences in `lengths`, in order;
    the groups come in the order of their first sequence. On a CPU one 4096-token document at a
    time."""
    groups: list[list[int]] = []
    filling: dict[int, list[int]] = {}  # bucket length -> its group being filled
    for i, n in enumerate(lengths):
        bucket = bucket_length(n, bucket_size)
        group = filling.get(bucket)
        if group is None or (len(group) + 1) * bucket > max_batch_tokens:
            group = filling[bucket] = []
            groups.append(group)
        group.append(i)
    return groups


class BatchingPolicy:
    def __init__(self, max_batch_tokens: int, max_batch_size: int, max_wait_s: float, bucket_size: int):
        if max_batch_tokens < 1 or max_batch_size < 1 or bucket_size < 1 or max_wait_s < 0:
            raise ValueError("batching limits must be positive")
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self.bucket_size = bucket_size
        self._buckets: dict[int, deque[Entry]] = {}
        self._order: OrderedDict[int, Entry] = OrderedDict()  # seq -> entry, arrival order
        self._next_seq = 0
        self._cancelled: list[Entry] = []
        self.queued_tokens = 0
        self._owners: dict[Any, list[int]] = {}  # owner -> [queued entries, tokens served so far]
        self._fifo_turn = True  # whose turn the next released head is: FIFO, or least served

    def bucket_of(self, length: int) -> int:
        return bucket_length(length, self.bucket_size)

    def __len__(self) -> int:
        return len(self._order)

    def append(self, entry: Entry) -> None:
        if entry.length < 1:
            raise ValueError("an entry has at least one token")
        entry.seq = self._next_seq
        self._next_seq += 1
        self._buckets.setdefault(self.bucket_of(entry.length), deque()).append(entry)
        self._order[entry.seq] = entry
        self.queued_tokens += entry.length
        self._owners.setdefault(entry.owner, [0, 0])[0] += 1

    def _remove(self, entry: Entry) -> None:
        del self._order[entry.seq]
        self.queued_tokens -= entry.length
        owner = self._owners[entry.owner]
        owner[0] -= 1
        if not owner[0]:  # forgotten once it has nothing queued
            del self._owners[entry.owner]

    def _head(self) -> Entry:
        """The sequence the next released batch starts with (see the module's rules)."""
        oldest = next(iter(self._order.values()))
        fifo, self._fifo_turn = self._fifo_turn, not self._fifo_turn
        if fifo or len(self._owners) == 1:
            return oldest
        least = min(self._owners, key=lambda o: self._owners[o][1])
        return next(e for e in self._order.values() if e.owner == least)

    def _prune(self) -> None:
        """Move cancelled entries out of the queue (they come back from drop_cancelled)."""
        for bucket, entries in list(self._buckets.items()):
            kept = deque()
            for e in entries:
                if e.is_cancelled():
                    self._remove(e)
                    self._cancelled.append(e)
                else:
                    kept.append(e)
            if kept:
                self._buckets[bucket] = kept
            else:
                del self._buckets[bucket]

    def drop_cancelled(self) -> list[Entry]:
        """Entries found cancelled since the last call (the caller fails their futures)."""
        self._prune()
        dropped, self._cancelled = self._cancelled, []
        return dropped

    def _capacity(self, bucket: int, budget: int) -> int:
        return max(1, min(self.max_batch_size, budget // bucket))

    def next_wakeup(self) -> float | None:
        """When the oldest entry's wait runs out (caller's clock), or None if the queue is empty."""
        if not self._order:
            return None
        return next(iter(self._order.values())).arrival + self.max_wait_s

    def next_batch(self, now: float, budget: int | None = None, force: bool = False) -> Batch | None:
        """The next batch to run, removed from the queue, or None if nothing should run yet.
        `budget` overrides max_batch_tokens (e.g. a worker's own limit); `force` releases the
        oldest entry's bucket without waiting (e.g. when draining)."""
        budget = self.max_batch_tokens if budget is None else budget
        self._prune()
        if not self._order:
            return None
        oldest = next(iter(self._order.values()))
        if force or now - oldest.arrival >= self.max_wait_s:
            head = self._head()
            chosen = self.bucket_of(head.length)
            entries = self._buckets[chosen]
            entries.remove(head)
            entries.appendleft(head)  # the batch starts with the head, then FIFO in its bucket
        else:  # a full bucket may go before the head's wait runs out; oldest full bucket first
            full = [
                (entries[0].seq, b)
                for b, entries in self._buckets.items()
                if len(entries) >= self._capacity(b, budget)
            ]
            if not full:
                return None
            chosen = min(full)[1]
        entries = self._buckets[chosen]
        take = [entries.popleft() for _ in range(min(len(entries), self._capacity(chosen, budget)))]
        if not entries:
            del self._buckets[chosen]
        for e in take:
            self._owners[e.owner][1] += e.length
            self._remove(e)
        return Batch(tuple(take), chosen)


# ---------------------------------------------------------------------------------------------
# admission: what a model's queue accepts (docs/service.md, "Admission and fairness")


@dataclass(frozen=True)
class QueueBudget:
    """A request is charged its whole token cost (every window of every document) before it is
    accepted, and the last `small_share` of the budget is kept for small requests:

    - cost > max_request_tokens (the budget less the reserve): 413, it can never be admitted;
    - a large request (cost > reserve) is admitted while `queued + cost <= max_request_tokens`;
    - a small request (cost <= reserve) is admitted while `queued + cost <= max_tokens`.

    So one large request can never fill the queue: small requests always find the reserve.
    `max_wait_s` bounds the queue in time as well (`admit`, service/batcher.py): once the drain rate
    is measured, a request that would wait longer than that behind the queued tokens gets 429."""

    max_tokens: int
    small_share: float = 0.25
    max_wait_s: float = math.inf

    @property
    def reserve(self) -> int:
        return int(self.max_tokens * self.small_share)

    @property
    def max_request_tokens(self) -> int:
        return self.max_tokens - self.reserve

    def excess(self, queued: int, cost: int) -> int:
        """Queued tokens that must drain before a request of `cost` fits the token budget (0: it
        fits now). The caller checks `cost <= max_request_tokens` first."""
        limit = self.max_tokens if cost <= self.reserve else self.max_request_tokens
        return max(0, queued + cost - limit)

    def late(self, queued: int, cost: int, tokens_per_s: float) -> int:
        """Queued tokens that must drain, at `tokens_per_s`, before a request of `cost` would wait
        at most `max_wait_s` for the queue and itself (0: now; always 0 for an empty queue, which
        takes one request however long, and before the rate is measured)."""
        if not queued or not tokens_per_s or math.isinf(self.max_wait_s):
            return 0
        return max(0, min(queued, math.ceil(queued + cost - self.max_wait_s * tokens_per_s)))


class DrainRate:
    """Tokens leaving a queue per second (moving average), to turn queued tokens into seconds."""

    def __init__(self):
        self.tokens_per_s = 0.0
        self._mark: float | None = None  # the last departure that left tokens waiting

    def observe(self, tokens: int, seconds: float) -> None:
        rate = tokens / max(seconds, 1e-6)
        self.tokens_per_s = rate if not self.tokens_per_s else 0.8 * self.tokens_per_s + 0.2 * rate

    def departed(self, tokens: int, now: float, still_queued: bool) -> None:
        """`tokens` left the queue at `now`. The time since the previous departure measures the
        rate only when tokens were waiting all along: a backlog drains at the pace of all the
        workers together, gaps between batches included (a request that arrives at an idle queue
        leaves at once and says nothing). (Tokens over the run time of one worker's batch, measured
        before, left out both and over-stated the rate under load: an admitted p99 of 16.6 s
        against a 10 s bound.)"""
        if self._mark is not None:
            self.observe(tokens, now - self._mark)
        self._mark = now if still_queued else None

    def seconds(self, tokens: int) -> float:
        """Seconds for `tokens` to drain at the measured rate (0 while nothing is measured)."""
        return tokens / self.tokens_per_s if self.tokens_per_s else 0.0

    def retry_after(self, tokens: int) -> int:
        """Whole seconds until `tokens` more have drained, in [1, 60]; 60 while nothing has been
        measured (a cold model's throughput is unknown)."""
        if not self.tokens_per_s:
            return 60
        return max(1, min(60, math.ceil(tokens / self.tokens_per_s)))
