"""The benchmark harness: prompt sets, record schema, speedup arithmetic, interleaving, a real run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edgespec.bench.prompts import SPECBENCH_CATEGORY, load_prompts, load_suite, select
from edgespec.bench.summary import OVERALL, PLAIN, Record, interleaved_order, summarize
from edgespec.errors import InvalidRequest

EDGESPEC = str(Path(sys.executable).with_name("edgespec"))


def rec(pid, cat, cfg, tokens, secs, steps=0, drafted=0, accepted=0, repeat=0):
    return Record(id=pid, category=cat, config=cfg, new_tokens=tokens, gen_s=secs, prefill_s=0.1,
                  steps=steps, drafted=drafted, accepted=accepted, peak_rss_bytes=1, text="",
                  repeat=repeat)


def test_specbench_suite_categories():
    prompts = load_suite("specbench")
    assert len(prompts) == 480
    cats = {p.category for p in prompts}
    assert cats == {SPECBENCH_CATEGORY, "translation", "summarization", "qa", "math_reasoning", "rag"}
    assert all(p.templated for p in prompts)


def test_limit_is_per_category_deterministic_and_spread():
    prompts = load_suite("specbench")
    a, b = select(prompts, 5), select(prompts, 5)
    assert [p.id for p in a] == [p.id for p in b]
    assert len(a) == 30
    multi = [p for p in a if p.category == SPECBENCH_CATEGORY]
    # Evenly spaced through the 80 multi-turn questions: several MT-bench sub-categories.
    assert len({int(p.id) // 10 for p in multi}) >= 4


def test_prompt_file_formats_and_errors(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"id": "a", "category": "x", "turns": ["hello", "ignored"]}\n'
                 '{"id": "b", "category": "y", "prompt": "raw text"}\n')
    ps = load_prompts(f)
    assert (ps[0].text, ps[0].templated, ps[1].text, ps[1].templated) == ("hello", True, "raw text", False)
    for bad, msg in [('{"id": 1}', "category"), ('[1]', "JSON object"), ('nope', "not JSON"),
                     ('{"id": 1, "category": "c", "turns": []}', "turns"),
                     ('{"id": 1, "category": "c"}\n', "turns")]:
        f.write_text(bad + "\n")
        with pytest.raises(InvalidRequest, match=msg):
            load_prompts(f)
    with pytest.raises(InvalidRequest, match="not found"):
        load_prompts(tmp_path / "missing.jsonl")


def test_speedup_arithmetic():
    records = [
        rec("1", "a", PLAIN, 100, 10.0, steps=99), rec("1", "a", "suffix", 100, 5.0, steps=33),
        rec("2", "b", PLAIN, 100, 20.0, steps=99), rec("2", "b", "suffix", 100, 20.0, steps=99),
    ]
    s = summarize(records)
    assert s[PLAIN]["a"]["speedup"] == pytest.approx(1.0)
    assert s["suffix"]["a"]["tokens_per_s"] == pytest.approx(20.0)
    assert s["suffix"]["a"]["speedup"] == pytest.approx(2.0)
    assert s["suffix"]["b"]["speedup"] == pytest.approx(1.0)
    # Overall: mean of per-prompt tok/s (20, 5) over plain's (10, 5).
    assert s["suffix"][OVERALL]["speedup"] == pytest.approx(12.5 / 7.5)
    assert s["suffix"]["a"]["mean_emitted"] == pytest.approx(99 / 33)
    assert s[PLAIN][OVERALL]["mean_emitted"] == pytest.approx(1.0)


def test_repeat_spread():
    records = [rec("1", "a", PLAIN, 10, 1.0, repeat=0), rec("1", "a", "x", 10, 0.5, repeat=0),
               rec("1", "a", PLAIN, 10, 1.0, repeat=1), rec("1", "a", "x", 10, 0.25, repeat=1)]
    o = summarize(records)["x"][OVERALL]
    assert (o["speedup_min"], o["speedup_max"]) == pytest.approx((2.0, 4.0))


def test_interleaving_order():
    order = interleaved_order(["p1", "p2"], ["suffix", PLAIN, "model"], repeats=2)
    assert order[:6] == [(0, "p1", PLAIN), (0, "p1", "suffix"), (0, "p1", "model"),
                         (0, "p2", PLAIN), (0, "p2", "suffix"), (0, "p2", "model")]
    assert len(order) == 12 and order[6] == (1, "p1", PLAIN)


def test_short_real_run_json_schema(tmp_path, model_path):
    model_path("smollm2-135m")
    out = tmp_path / "bench.json"
    # Short prompts of two categories, chat-templated and raw: the command, --limit, the record
    # schema and the summary are what is under test, not SpecBench's 800-token RAG prompts
    # (the suite itself is checked above without a model).
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in [
        {"id": "c1", "category": "code", "turns": ["Write a Python function that adds two numbers."]},
        {"id": "c2", "category": "code", "turns": ["Write a Python function that reverses a list."]},
        {"id": "p1", "category": "prose", "prompt": "The capital of France is"},
        {"id": "p2", "category": "prose", "prompt": "Once upon a time, in a small village,"},
    ]) + "\n")
    proc = subprocess.run([EDGESPEC, "bench", "--prompts", str(prompts), "--limit", "1", "--max-tokens", "16",
                           "--model", "smollm2-135m", "--configs", "plain,suffix,none", "--json", str(out)],
                          capture_output=True, text=True, timeout=900, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert {"machine", "records", "summary"} <= set(data)
    assert {"cpu", "physical_cores", "threads", "llama_cpp_python", "edgespec", "git_commit"} <= set(data["machine"])
    assert len(data["records"]) == 2 * 3  # --limit 1: one prompt per category, three configs each
    assert {r["category"] for r in data["records"]} == {"code", "prose"}
    assert all(r["new_tokens"] > 0 for r in data["records"])
    need = {"id", "category", "config", "new_tokens", "gen_s", "prefill_s", "steps", "drafted",
            "accepted", "peak_rss_bytes", "text"}
    assert all(need <= set(r) for r in data["records"])
    configs = [r["config"] for r in data["records"]]
    assert configs[:3] == ["plain", "suffix", "none"]  # interleaved prompt by prompt
    for cfg in ("plain", "suffix", "none"):
        cell = data["summary"][cfg]["overall"]
        assert {"tokens_per_s", "speedup", "mean_emitted"} <= set(cell)
    assert data["summary"]["plain"]["overall"]["speedup"] == pytest.approx(1.0)
    assert "speedup" in proc.stdout or "tokens/s" in proc.stdout


def test_shared_prefill_evaluates_each_prompt_once(model_path):
    from edgespec.bench.runner import BenchSettings, run_bench

    model_path("smollm2-135m")
    prompts = select(load_suite("specbench"), 1)[:3]
    settings = BenchSettings(model="smollm2-135m", max_tokens=24, share_prefill=True)
    result = run_bench(prompts, ["plain", "none", "suffix"], settings)
    by = {(r.id, r.config): r for r in result.records}
    for p in prompts:
        reused = {cfg: by[(p.id, cfg)].reused_prompt_tokens for cfg in ("plain", "none", "suffix")}
        # Every configuration, plain included, finds all but the last prompt token cached ...
        assert len(set(reused.values())) == 1 and reused["plain"] > 10
        # ... so one-token steps reproduce plain decoding exactly, from the first token on.
        assert by[(p.id, "none")].text == by[(p.id, "plain")].text
        assert by[(p.id, "plain")].prefill_s > by[(p.id, "none")].prefill_s


def test_bench_needs_exactly_one_source():
    proc = subprocess.run([EDGESPEC, "bench"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "exactly one of --suite or --prompts" in proc.stderr
