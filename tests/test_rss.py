"""Resident memory split into what the kernel can reclaim (mapped files) and what it cannot."""
from __future__ import annotations

import mmap
import time

import pytest

from conftest import SMALL
from edgespec.decode.request import GenerationRequest
from edgespec.decode.sampling import SamplingParams
from edgespec.memory import rss
from edgespec.memory.rss import PeakRSS, resident

MiB = 1 << 20
PAGE = mmap.PAGESIZE


def _fresh_anonymous(size: int) -> mmap.mmap:
    """``size`` bytes of new anonymous pages, each written once. An mmap of its own: a malloc'd
    buffer may reuse heap pages an earlier test freed (still resident), and then nothing grows."""
    block = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for i in range(0, size, PAGE):
        block[i] = 1
    return block


def _touch(buf) -> int:
    """Reads one byte per page so every page is resident; returns a checksum to keep it honest."""
    return sum(buf[i] for i in range(0, len(buf), PAGE))


def test_the_split_adds_up_and_the_peak_bounds_it():
    r = resident()
    assert r.anon > 0 and r.file > 0  # the interpreter's heap; its own mapped binaries
    assert r.anon + r.file == r.rss  # VmRSS = RssAnon + RssFile + RssShmem
    assert r.hwm >= r.rss


def test_anonymous_memory_counts_as_anon_and_a_mapped_file_as_file(tmp_path):
    before = resident()
    block = _fresh_anonymous(64 * MiB)
    grown = resident()
    assert grown.anon - before.anon >= 60 * MiB
    assert abs(grown.file - before.file) < 8 * MiB
    block.close()

    path = tmp_path / "weights.bin"
    path.write_bytes(b"\2" * (48 * MiB))
    before = resident()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        assert _touch(m) == 2 * (48 * MiB // PAGE)
        mapped = resident()
    assert mapped.file - before.file >= 44 * MiB
    assert abs(mapped.anon - before.anon) < 8 * MiB


def test_peak_sampler_keeps_a_peak_that_is_gone_at_exit():
    with PeakRSS(interval_s=0.005) as peak:
        start = resident().anon
        block = _fresh_anonymous(64 * MiB)
        time.sleep(0.1)
        block.close()
    assert resident().anon < start + 32 * MiB  # freed: the current size no longer shows it
    assert peak.peak_anon >= start + 60 * MiB
    assert peak.process_peak >= peak.peak >= peak.peak_anon


def test_without_proc_everything_counts_as_anon(monkeypatch):
    monkeypatch.setattr(rss, "_STATUS", "/nonexistent/status")
    r = resident()
    assert r.file == 0 and r.anon == r.rss > 0 and r.hwm >= r.rss


@pytest.fixture(scope="module")
def small_engine():
    from edgespec.engine import Engine, EngineConfig

    with Engine(EngineConfig(model=SMALL, n_ctx=512)) as e:
        yield e


def test_request_stats_report_the_request_and_the_process_peak(small_engine):
    from edgespec.cli.common import stats_line

    req = GenerationRequest(max_tokens=8, sampling=SamplingParams(temperature=0), ignore_eos=True)
    done = small_engine.decoder.generate(small_engine.text_tokens("Count: 1, 2, 3,"), req)
    st = done.stats
    # Loading faulted the weights in before the request began, so the process peak covers it.
    assert st.process_peak_rss_bytes >= st.peak_rss_bytes >= st.peak_anon_bytes > 0
    assert st.process_peak_rss_bytes >= resident().rss
    d = st.to_dict()
    assert {"peak_rss_bytes", "peak_anon_bytes", "process_peak_rss_bytes"} <= set(d)
    line = stats_line(st)
    assert "peak RSS" in line and "anon" in line and "process" in line
