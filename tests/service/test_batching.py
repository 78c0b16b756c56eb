"""The pure batching policy: budget, buckets, waiting, fairness, cancellation."""

from hypothesis import given, settings
from hypothesis import strategies as st

from longdoc.service.batching import BatchingPolicy, Entry, budget_groups


def policy(budget=256, size=8, wait=0.010, bucket=16):
    return BatchingPolicy(max_batch_tokens=budget, max_batch_size=size, max_wait_s=wait, bucket_size=bucket)


def test_empty_queue_gives_nothing():
    p = policy()
    assert p.next_batch(now=100.0) is None
    assert p.next_batch(now=100.0, force=True) is None
    assert p.next_wakeup() is None and len(p) == 0


def test_waits_for_max_wait_then_releases():
    p = policy(wait=0.010)
    p.append(Entry(length=10, arrival=0.0))
    assert p.next_batch(now=0.005) is None
    assert p.next_wakeup() == 0.010
    b = p.next_batch(now=0.010)
    assert b is not None and len(b.entries) == 1 and b.bucket_length == 16
    assert p.queued_tokens == 0 and len(p) == 0


def test_budget_hit_exactly_releases_without_waiting():
    p = policy(budget=64, size=100, bucket=16)
    for i in range(4):  # 4 x 16 = 64 = budget: full
        p.append(Entry(length=16 - i, arrival=0.0))
    b = p.next_batch(now=0.0)
    assert b is not None and len(b.entries) == 4 and b.padded_tokens == 64
    assert b.real_tokens == 16 + 15 + 14 + 13


def test_budget_splits_into_batches_that_fit():
    p = policy(budget=64, size=100, bucket=16)
    for _ in range(5):
        p.append(Entry(length=16, arrival=0.0))
    first = p.next_batch(now=1.0)
    second = p.next_batch(now=1.0)
    assert [len(first.entries), len(second.entries)] == [4, 1]
    assert p.next_batch(now=1.0) is None


def test_max_batch_size_caps_count():
    p = policy(budget=10_000, size=3)
    for _ in range(7):
        p.append(Entry(length=5, arrival=0.0))
    sizes = []
    while (b := p.next_batch(now=0.0, force=True)) is not None:
        sizes.append(len(b.entries))
    assert sizes == [3, 3, 1]


def test_oversize_entry_runs_alone():
    p = policy(budget=64, bucket=16)
    p.append(Entry(length=100, arrival=0.0))  # bucket 112 > budget 64
    p.append(Entry(length=100, arrival=0.0))
    b = p.next_batch(now=0.0)  # a single oversize entry is "full" on its own
    assert len(b.entries) == 1 and b.bucket_length == 112
    assert len(p.next_batch(now=0.0).entries) == 1


def test_cancelled_entries_are_skipped_and_handed_back():
    p = policy()
    gone = Entry(length=10, arrival=0.0, payload="gone", is_cancelled=lambda: True)
    keep = Entry(length=10, arrival=0.0, payload="keep")
    p.append(gone)
    p.append(keep)
    b = p.next_batch(now=1.0)
    assert [e.payload for e in b.entries] == ["keep"]
    assert [e.payload for e in p.drop_cancelled()] == ["gone"]
    assert p.drop_cancelled() == [] and p.queued_tokens == 0


def test_buckets_keep_short_sequences_apart_from_long_ones():
    p = policy(budget=10_000, size=100, bucket=16)
    p.append(Entry(length=10, arrival=0.0, payload="short1"))
    p.append(Entry(length=200, arrival=0.0, payload="long"))
    p.append(Entry(length=12, arrival=0.0, payload="short2"))
    b1 = p.next_batch(now=1.0)
    b2 = p.next_batch(now=1.0)
    assert [e.payload for e in b1.entries] == ["short1", "short2"] and b1.bucket_length == 16
    assert [e.payload for e in b2.entries] == ["long"] and b2.bucket_length == 208


def test_fairness_oldest_entry_is_served_once_its_wait_is_over():
    # A stream of short requests keeps filling its bucket; the old long one must not starve.
    p = policy(budget=128, size=4, wait=0.010, bucket=16)
    p.append(Entry(length=40, arrival=0.0, payload="long"))
    for i in range(8):
        p.append(Entry(length=8, arrival=0.001, payload=f"s{i}"))
    # before the long one's wait is over, full short batches may go
    b = p.next_batch(now=0.005)
    assert all(e.payload.startswith("s") for e in b.entries)
    # once it is over, the long one goes next even though a full short batch is ready
    b = p.next_batch(now=0.010)
    assert [e.payload for e in b.entries] == ["long"]


def test_fifo_within_bucket():
    p = policy(budget=10_000, size=2)
    for i in range(4):
        p.append(Entry(length=5, arrival=0.0, payload=i))
    order = []
    while (b := p.next_batch(now=1.0)) is not None:
        order += [e.payload for e in b.entries]
    assert order == [0, 1, 2, 3]


def test_budget_override():
    p = policy(budget=10_000, size=100, bucket=16)
    for _ in range(4):
        p.append(Entry(length=16, arrival=0.0))
    assert len(p.next_batch(now=1.0, budget=32).entries) == 2


lengths = st.lists(st.tuples(st.integers(1, 300), st.booleans()), min_size=0, max_size=60)


@settings(max_examples=150, deadline=None)
@given(lengths, st.integers(16, 1024), st.integers(1, 16), st.sampled_from([1, 8, 16, 64]))
def test_never_exceeds_budget_and_loses_nothing(items, budget, size, bucket):
    p = BatchingPolicy(max_batch_tokens=budget, max_batch_size=size, max_wait_s=0.0, bucket_size=bucket)
    for n, (length, cancelled) in enumerate(items):
        p.append(Entry(length=length, arrival=float(n), payload=n, is_cancelled=lambda c=cancelled: c))
    seen = []
    while (b := p.next_batch(now=1e9)) is not None:
        assert 1 <= len(b.entries) <= size
        if len(b.entries) > 1:
            assert b.padded_tokens <= budget
        assert all(p.bucket_of(e.length) == b.bucket_length for e in b.entries)
        seen += [e.payload for e in b.entries]
    dropped = [e.payload for e in p.drop_cancelled()]
    assert sorted(seen + dropped) == list(range(len(items)))
    assert all(not items[i][1] for i in seen) and all(items[i][1] for i in dropped)
    assert p.queued_tokens == 0


def test_a_small_request_behind_a_large_one_gets_every_other_batch():
    p = policy(wait=0.0, size=1)
    for i in range(6):
        p.append(Entry(length=16, arrival=0.0, payload=("large", i), owner="large"))
    for i in range(2):
        p.append(Entry(length=16, arrival=1.0, payload=("small", i), owner="small"))
    order = [p.next_batch(now=2.0).entries[0].payload for _ in range(8)]
    assert order == [("large", 0), ("small", 0), ("large", 1), ("small", 1),
                     ("large", 2), ("large", 3), ("large", 4), ("large", 5)]
    assert p.next_batch(now=2.0) is None and p.queued_tokens == 0


def test_the_least_served_request_goes_first_on_its_turn():
    p = policy(wait=0.0, size=1)
    p.append(Entry(length=16, arrival=0.0, payload="a0", owner="a"))
    p.append(Entry(length=16, arrival=0.0, payload="a1", owner="a"))
    p.append(Entry(length=16, arrival=0.0, payload="b0", owner="b"))
    p.append(Entry(length=16, arrival=0.0, payload="c0", owner="c"))
    # FIFO: a0; least served (b and c have 0, b is older): b0; FIFO: a1; least served: c0
    assert [p.next_batch(now=1.0).entries[0].payload for _ in range(4)] == ["a0", "b0", "a1", "c0"]


def test_budget_groups_hold_one_bucket_within_the_budget():
    # buckets of 64: 100 -> 128, 60 -> 64, 200 -> 256, 4000 -> 4032
    assert budget_groups([100, 60, 100], 256, 64) == [[0, 2], [1]]  # one bucket a group: 60 is not padded to 128
    assert budget_groups([100, 110, 100], 256, 64) == [[0, 1], [2]]  # 128 * 2, then 128 * 3 > 256
    assert budget_groups([60, 200, 60], 512, 64) == [[0, 2], [1]]
    assert budget_groups([4000, 50], 1024, 64) == [[0], [1]]  # over the budget alone: alone
    assert budget_groups([4000] * 3, 1 << 20, 64) == [[0, 1, 2]]
    assert budget_groups([], 1024, 64) == []


@given(st.lists(st.integers(1, 5000), max_size=20), st.integers(1, 20000), st.sampled_from([1, 16, 64]))
@settings(max_examples=200, deadline=None)
def test_budget_groups_cover_everything_within_the_budget(lengths, budget, bucket):
    groups = budget_groups(lengths, budget, bucket)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert [g[0] for g in groups] == sorted(g[0] for g in groups)  # in the order of their first sequence
    buckets = [-(-n // bucket) * bucket for n in lengths]
    for g in groups:
        assert g == sorted(g) and len({buckets[i] for i in g}) == 1
        assert len(g) == 1 or buckets[g[0]] * len(g) <= budget
    for padded in set(buckets):  # a bucket's next group starts only when the budget is spent
        full = [g for g in groups if buckets[g[0]] == padded][:-1]
        assert all(padded * (len(g) + 1) > budget for g in full)
