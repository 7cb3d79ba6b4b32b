"""The benchmark harness: prompt sets, record schema, speedup arithmetic, interleaving, a real run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edgespec.bench.peers import NATIVE_PLAIN
from edgespec.bench.prompts import SPECBENCH_CATEGORY, SPLITS, SUITES, conversation, load_prompts, load_suite, select
from edgespec.bench.report import markdown
from edgespec.engine import EngineConfig
from edgespec.bench.runner import BenchSettings, validate_configs
from edgespec.bench.summary import OVERALL, PLAIN, Record, has_native_plain, interleaved_order, summarize
from edgespec.errors import InvalidRequest

EDGESPEC = str(Path(sys.executable).with_name("edgespec"))


def rec(pid, cat, cfg, tokens, secs, steps=0, drafted=0, accepted=0, repeat=0, turn=1):
    return Record(id=pid, category=cat, config=cfg, new_tokens=tokens, gen_s=secs, prefill_s=0.1,
                  steps=steps, drafted=drafted, accepted=accepted, peak_rss_bytes=1, text="",
                  repeat=repeat, turn=turn)


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


def test_validate_split_is_disjoint_from_the_tuning_picks():
    specbench = load_suite("specbench")
    tune, validate = select(specbench, 5), select(specbench, 5, "validate")
    assert len(validate) == 30 and not {p.id for p in tune} & {p.id for p in validate}
    assert {p.category for p in validate} == {p.category for p in tune}
    code = load_suite("code-edit")
    halves = select(code, 6), select(code, 6, "validate")
    assert sorted(p.id for p in halves[0] + halves[1]) == sorted(p.id for p in code)  # two halves
    with pytest.raises(InvalidRequest, match="needs --limit <= 6"):
        select(code, 7, "validate")
    with pytest.raises(InvalidRequest, match="needs --limit"):
        select(code, None, "validate")
    with pytest.raises(InvalidRequest, match="--split must be one of"):
        select(code, 3, "holdout")


def test_test_splits_are_disjoint_from_the_others():
    specbench = load_suite("specbench")
    picks = [{p.id for p in select(specbench, 5, split)} for split in SPLITS]
    assert SPLITS == ("tune", "validate", "test", "test2", "test3", "test4")
    assert [len(p) for p in picks] == [30] * 6
    assert len(set().union(*picks)) == 180
    with pytest.raises(InvalidRequest, match="--split test2 needs --limit <= 3"):
        select(load_suite("code-edit"), 4, "test2")
    with pytest.raises(InvalidRequest, match="--split test needs --limit <= 3"):
        select(load_suite("code-edit"), 4, "test")  # 12 per category: a quarter-step of 3 or more
    with pytest.raises(InvalidRequest, match="--split test3 needs --limit <= 1"):
        select(load_suite("code-edit"), 2, "test3")  # an eighth-step of 6 needs 8 per pick


def test_validation_and_test_suites_come_from_other_packages():
    tuned, fresh, test = load_suite("code-edit"), load_suite("code-edit-validation"), load_suite("code-edit-test")
    assert {p.category for p in fresh} == {p.category for p in tuned} == {p.category for p in test}
    assert len({p.id for p in tuned} | {p.id for p in fresh} | {p.id for p in test}) == len(tuned + fresh + test)
    rows = [json.loads(line) for name in ("code-edit", "code-edit-validation", "code-edit-test")
            for line in SUITES[name].read_text().splitlines()]
    packages = [{r["source"]["package"] for r in rows if r["id"].startswith(prefix)}
                for prefix in ("code-edit-0", "code-edit-v", "code-edit-t")]
    assert all(packages) and not (packages[0] & packages[1] or packages[0] & packages[2] or packages[1] & packages[2])


def test_recheck_configurations_need_a_gap_and_the_gap_needs_them():
    assert validate_configs(["auto", "auto+recheck"], 0.5) == ["plain", "auto", "auto+recheck"]
    with pytest.raises(InvalidRequest, match=r"auto\+recheck needs --recheck-gap"):
        validate_configs(["auto+recheck"], 0.0)
    with pytest.raises(InvalidRequest, match="applies to configurations named"):
        validate_configs(["auto"], 0.5)
    for bad in ("plain+recheck", "peer:llama.cpp-plain+recheck", "nonsense+recheck"):
        with pytest.raises(InvalidRequest, match="unknown config"):
            validate_configs([bad], 0.5)


def test_prompt_file_formats_and_errors(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"id": "a", "category": "x", "turns": ["hello", "again"]}\n'
                 '{"id": "b", "category": "y", "prompt": "raw text"}\n')
    ps = load_prompts(f)
    assert (ps[0].text, ps[0].templated, ps[1].text, ps[1].templated) == ("hello", True, "raw text", False)
    assert (ps[0].follow_ups, ps[1].n_turns) == (("again",), 1)
    with pytest.raises(InvalidRequest, match="raw text"):
        conversation(ps[1], ["an answer"])
    for bad, msg in [('{"id": 1, "category": "c", "turns": ["a", 2]}', "turns"), ('{"id": 1}', "category"), ('[1]', "JSON object"), ('nope', "not JSON"),
                     ('{"id": 1, "category": "c", "turns": []}', "turns"),
                     ('{"id": 1, "category": "c"}\n', "turns")]:
        f.write_text(bad + "\n")
        with pytest.raises(InvalidRequest, match=msg):
            load_prompts(f)
    with pytest.raises(InvalidRequest, match="not found"):
        load_prompts(tmp_path / "missing.jsonl")


def test_speedup_arithmetic():
    records = [
        rec("1", "a", PLAIN, 100, 10.0, steps=99), rec("1", "a", "suffix", 100, 5.0, steps=33, accepted=66),
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
    # An answer ended by an end-of-generation token: its last step emitted that token too, so a
    # step that drafted nothing counts as one token, not as the answer's tokens over its steps.
    eog = summarize([rec("3", "c", PLAIN, 15, 1.0, steps=14), rec("3", "c", "none", 15, 1.0, steps=15)])
    assert eog["none"]["c"]["mean_emitted"] == pytest.approx(1.0)
    # Drafts accepted past the end of the answer (a copied "<|im_end|>..." run) are not emitted.
    past = summarize([rec("4", "d", PLAIN, 15, 1.0, steps=14), rec("4", "d", "suffix", 15, 1.0, steps=3, accepted=20)])
    assert past["suffix"]["d"]["mean_emitted"] == pytest.approx(15 / 3)


def test_repeat_spread():
    records = [rec("1", "a", PLAIN, 10, 1.0, repeat=0), rec("1", "a", "x", 10, 0.5, repeat=0),
               rec("1", "a", PLAIN, 10, 1.0, repeat=1), rec("1", "a", "x", 10, 0.25, repeat=1)]
    o = summarize(records)["x"][OVERALL]
    assert (o["speedup_min"], o["speedup_max"]) == pytest.approx((2.0, 4.0))


def test_interleaving_order():
    order = interleaved_order(["p1", "p2"], ["suffix", PLAIN, "model"], repeats=2)
    assert order[:6] == [(0, "p1", 1, PLAIN), (0, "p1", 1, "suffix"), (0, "p1", 1, "model"),
                         (0, "p2", 1, PLAIN), (0, "p2", 1, "suffix"), (0, "p2", 1, "model")]
    assert len(order) == 12 and order[6] == (1, "p1", 1, PLAIN)


def test_interleaving_order_runs_plain_first_in_every_turn():
    order = interleaved_order(["p1", "p2"], ["suffix"], repeats=1, turns={"p1": 2})
    assert order == [(0, "p1", 1, PLAIN), (0, "p1", 1, "suffix"), (0, "p1", 2, PLAIN),
                     (0, "p1", 2, "suffix"), (0, "p2", 1, PLAIN), (0, "p2", 1, "suffix")]


def test_specbench_turns_and_conversation():
    prompts = {p.id: p for p in load_suite("specbench")}
    multi = [p for p in prompts.values() if p.category == SPECBENCH_CATEGORY]
    assert len(multi) == 80 and all(p.n_turns == 2 for p in multi)
    assert all(p.n_turns == 1 for p in prompts.values() if p.category != SPECBENCH_CATEGORY)
    p = multi[0]
    assert conversation(p) == [{"role": "user", "content": p.text}]
    assert conversation(p, ["A1"]) == [{"role": "user", "content": p.text},
                                       {"role": "assistant", "content": "A1"},
                                       {"role": "user", "content": p.follow_ups[0]}]
    with pytest.raises(InvalidRequest, match="2 turn"):
        conversation(p, ["A1", "A2"])


def test_turns_setting_is_checked_before_anything_loads():
    assert BenchSettings(turns="all").turns == "all"
    with pytest.raises(InvalidRequest, match="--turns"):
        BenchSettings(turns="2")


def test_later_turns_are_their_own_group():
    records = [rec("1", "mt", PLAIN, 10, 1.0), rec("1", "mt", "suffix", 10, 0.5),
               rec("1", "mt", PLAIN, 10, 2.0, turn=2), rec("1", "mt", "suffix", 10, 0.5, turn=2)]
    s = summarize(records)
    assert list(s["suffix"]) == ["mt", "mt (turn 2)", OVERALL]
    assert s["suffix"]["mt"]["speedup"] == pytest.approx(2.0)
    assert s["suffix"]["mt (turn 2)"]["speedup"] == pytest.approx(4.0)
    assert s["suffix"][OVERALL]["speedup"] == pytest.approx(20.0 / 7.5)  # every turn


def test_speedup_over_native_plain():
    """Every configuration gets a ratio over native plain too, per category and overall."""
    records = [rec("1", "a", PLAIN, 100, 10.0), rec("1", "a", NATIVE_PLAIN, 100, 8.0),
               rec("1", "a", "peer:llama.cpp-ngram-mod", 100, 4.0),
               rec("2", "b", PLAIN, 100, 10.0), rec("2", "b", NATIVE_PLAIN, 100, 10.0),
               rec("2", "b", "peer:llama.cpp-ngram-mod", 100, 5.0)]
    s = summarize(records)
    mod = s["peer:llama.cpp-ngram-mod"]
    assert mod["a"]["speedup"] == pytest.approx(2.5) and mod["a"]["speedup_native"] == pytest.approx(2.0)
    assert mod["b"]["speedup_native"] == pytest.approx(2.0)
    assert mod[OVERALL]["speedup_native"] == pytest.approx(22.5 / 11.25)
    assert s[PLAIN]["a"]["speedup_native"] == pytest.approx(0.8)
    assert s[NATIVE_PLAIN][OVERALL]["speedup_native"] == pytest.approx(1.0)
    assert has_native_plain(s)
    without = summarize([r for r in records if r.config != NATIVE_PLAIN])
    assert not has_native_plain(without)
    assert without["peer:llama.cpp-ngram-mod"]["a"]["speedup_native"] is None


def test_markdown_has_native_table_only_with_native_plain():
    records = [rec("1", "a", PLAIN, 100, 10.0), rec("1", "a", NATIVE_PLAIN, 100, 8.0),
               rec("1", "a", "peer:llama.cpp-ngram-mod", 100, 4.0)]
    machine = {"cpu": "cpu", "physical_cores": 2, "threads": 2, "llama_cpp_python": "0", "edgespec": "0"}

    def md(rs):
        return markdown({"machine": machine, "records": [r.to_dict() for r in rs]}, "t", "edgespec bench")

    text = md(records)
    assert f"native plain decoding ({NATIVE_PLAIN})" in text
    assert "| peer:llama.cpp-ngram-mod | 2.00x | 2.00x |" in text
    assert "| plain | 0.80x | 0.80x |" in text
    assert "native plain" not in md(records[:1] + records[2:])


def test_markdown_counts_rechecks_per_configuration():
    records = [rec("1", "a", PLAIN, 100, 10.0), rec("1", "a", "auto", 100, 5.0, steps=20),
               rec("1", "a", "auto+recheck", 100, 5.5, steps=22)]
    records[2].rechecks = 3
    machine = {"cpu": "cpu", "physical_cores": 2, "threads": 2, "llama_cpp_python": "0", "edgespec": "0"}
    text = markdown({"machine": machine, "records": [r.to_dict() for r in records]}, "t", "edgespec bench")
    assert "re-checks (positions re-decoded alone / tokens): auto+recheck 3/100." in text
    assert "re-checks" not in markdown({"machine": machine, "records": [r.to_dict() for r in records[:2]]}, "t", "x")


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
                           "--model", "smollm2-135m", "--configs", "plain,suffix,none,suffix+recheck",
                           "--recheck-gap", "1.0", "--json", str(out)],
                          capture_output=True, text=True, timeout=900, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert {"machine", "records", "summary"} <= set(data)
    assert {"cpu", "physical_cores", "threads", "llama_cpp_python", "edgespec", "git_commit"} <= set(data["machine"])
    assert len(data["records"]) == 2 * 4  # --limit 1: one prompt per category, four configs each
    assert {r["category"] for r in data["records"]} == {"code", "prose"}
    assert all(r["new_tokens"] > 0 for r in data["records"])
    need = {"id", "category", "config", "new_tokens", "gen_s", "prefill_s", "steps", "drafted",
            "accepted", "peak_rss_bytes", "text", "rechecks"}
    assert all(need <= set(r) for r in data["records"])
    configs = [r["config"] for r in data["records"]]
    assert configs[:4] == ["plain", "suffix", "none", "suffix+recheck"]  # interleaved prompt by prompt
    assert not any(r["rechecks"] for r in data["records"] if r["config"] != "suffix+recheck")
    for cfg in ("plain", "suffix", "none", "suffix+recheck"):
        cell = data["summary"][cfg]["overall"]
        assert {"tokens_per_s", "speedup", "mean_emitted"} <= set(cell)
    assert data["summary"]["plain"]["overall"]["speedup"] == pytest.approx(1.0)
    assert "speedup" in proc.stdout or "tokens/s" in proc.stdout


def test_shared_prefill_evaluates_each_prompt_once(model_path):
    from edgespec.bench.runner import BenchSettings, run_bench

    model_path("smollm2-135m")
    # The three shortest categories' prompts: what is shared does not depend on the length, and
    # SmolLM2 evaluates the summarization and RAG prompts' ~800 tokens at ~90 tokens/s here.
    prompts = sorted(select(load_suite("specbench"), 1), key=lambda p: len(p.text))[:3]
    settings = BenchSettings(EngineConfig(model="smollm2-135m"), max_tokens=24, share_prefill=True)
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


def test_all_turns_share_plain_history(tmp_path, model_path):
    """--turns all: the second turn runs for every config on the same history (plain's answer)."""
    from edgespec.bench.runner import run_bench

    model_path("smollm2-135m")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in [
        {"id": "two", "category": "chat", "turns": ["Name three colours.", "Now repeat them in reverse order."]},
        {"id": "one", "category": "chat", "turns": ["Name a fruit."]},
    ]) + "\n")
    settings = BenchSettings(EngineConfig(model="smollm2-135m"), max_tokens=12, turns="all")
    result = run_bench(load_prompts(prompts), ["plain", "suffix"], settings)
    by = {(r.id, r.turn, r.config): r for r in result.records}
    assert sorted(by) == sorted((pid, t, cfg) for pid, t in [("two", 1), ("two", 2), ("one", 1)]
                                for cfg in ("plain", "suffix"))
    first, second = by[("two", 1, "plain")], by[("two", 2, "plain")]
    # the second prompt holds the first turn, plain's answer and the second user message
    assert second.prompt_tokens > first.prompt_tokens + first.new_tokens
    assert by[("two", 2, "suffix")].prompt_tokens == second.prompt_tokens
    assert by[("two", 2, "suffix")].same_as_plain is not None
    assert "chat (turn 2)" in result.summary["suffix"]
    assert result.settings["turns"] == "all"


def test_sampled_runs_compare_no_answers_with_plain(tmp_path, model_path):
    """A sampled answer follows its drafts (they consume the seed differently), so a sampled
    bench says nothing about answers identical to plain's; a greedy one does."""
    from edgespec.bench.runner import run_bench

    model_path("smollm2-135m")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "one", "category": "chat", "turns": ["Name a fruit."]}) + "\n")
    for temperature, compared in ((0.7, False), (0.0, True)):
        settings = BenchSettings(EngineConfig(model="smollm2-135m"), max_tokens=8, temperature=temperature)
        result = run_bench(load_prompts(prompts), ["plain", "suffix"], settings)
        suffix = next(r for r in result.records if r.config == "suffix")
        assert (suffix.same_as_plain is not None) is compared
