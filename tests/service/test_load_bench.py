"""bench/load.py's pure parts: arrival processes and the ideal FIFO server it replays them through."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

_spec = importlib.util.spec_from_file_location("bench_load", Path(__file__).resolve().parents[2] / "bench" / "load.py")
load = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(load)


def test_arrival_times():
    paced = load.arrival_times("paced", 10.0, 5)
    np.testing.assert_allclose(paced, [0.0, 0.1, 0.2, 0.3, 0.4])
    poisson = load.arrival_times("poisson", 10.0, 20000, seed=1)
    assert poisson[0] == 0.0 and np.all(np.diff(poisson) >= 0)
    assert np.mean(np.diff(poisson)) == pytest.approx(0.1, rel=0.03)
    with pytest.raises(ValueError):
        load.arrival_times("bursty", 1.0, 3)


def test_ideal_fifo_server():
    # arrivals at 0, 0, 0.5, 3 with service 1: the second waits 1, the third waits until 2
    np.testing.assert_allclose(load.ideal_fifo([0.0, 0.0, 0.5, 3.0], 1.0), [1.0, 2.0, 2.5, 1.0])
    # paced below saturation: no queueing at all
    lat = load.ideal_fifo(load.arrival_times("paced", 10.0, 100), 0.07)
    np.testing.assert_allclose(lat, 0.07)
    # Poisson at utilisation 0.7 (M/D/1): the mean wait is rho / (2 (1 - rho)) service times
    # (Pollaczek-Khinchine), and p99 is far above twice p50 even for this ideal server
    lat = load.ideal_fifo(load.arrival_times("poisson", 10.0, 200000, seed=2), 0.07)
    assert np.mean(lat - 0.07) / 0.07 == pytest.approx(0.7 / (2 * 0.3), rel=0.05)
    q = load._percentiles(lat)
    assert q["p99_over_p50"] > 3
