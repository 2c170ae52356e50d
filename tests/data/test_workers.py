"""OrderedWorkers: results in input order, a stop that cannot hang, a dead worker named."""

import os
import signal
import time

import numpy as np
import pytest

from mct.data.workers import OrderedWorkers


def _offset(arg):
    return arg


def _no_setup(arg):
    raise ValueError(f"cannot load tokenizer {arg!r}")


def _shifted(offset, item):
    if item == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    if item == "bad":
        raise ValueError("data.txt:7: bad record")
    return offset + item


def _big(offset, item):
    return np.full(1 << 20, item + offset, dtype=np.int32)  # 4 MiB: far more than a pipe holds


@pytest.mark.parametrize("n", [1, 3])
def test_results_come_back_in_input_order(n):
    with OrderedWorkers(n, _offset, 100, _shifted) as workers:
        assert list(workers.map(range(23))) == [100 + i for i in range(23)]
    assert all(p.exitcode is not None for p in workers._procs)


def test_stopping_mid_stream_with_large_results_in_flight_returns_at_once():
    with OrderedWorkers(2, _offset, 0, _big) as workers:
        stream = workers.map(range(40))
        assert int(next(stream)[0]) == 0
        time.sleep(0.3)  # the workers now block writing results nobody reads
        t0 = time.monotonic()
        stream.close()
    assert time.monotonic() - t0 < 10
    assert all(p.exitcode is not None for p in workers._procs)


def test_a_killed_worker_is_named_in_one_error_not_waited_for():
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"worker 1 of 2 \(pid \d+\) was killed by SIGKILL .*out-of-memory"):
        with OrderedWorkers(2, _offset, 0, _shifted) as workers:
            list(workers.map([1, 2, 3, "die", 5, 6]))
    assert time.monotonic() - t0 < 30
    assert all(p.exitcode is not None for p in workers._procs)


def test_a_workers_exception_reaches_the_caller_with_its_type_and_message():
    with pytest.raises(ValueError, match="data.txt:7: bad record"):
        with OrderedWorkers(2, _offset, 0, _shifted) as workers:
            list(workers.map([1, 2, "bad", 4]))


def test_a_failed_setup_is_raised_in_the_caller_not_printed_by_the_worker(capfd):
    with pytest.raises(ValueError, match="cannot load tokenizer 'x.json'"):
        with OrderedWorkers(2, _no_setup, "x.json", _shifted) as workers:
            list(workers.map([1, 2, 3]))
    assert "Traceback" not in capfd.readouterr().err
