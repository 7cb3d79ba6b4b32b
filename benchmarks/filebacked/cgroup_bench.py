"""File-backed decoding under a real memory limit: a memory cgroup and a cold page cache per run.

`--ram-budget` below the weights' size makes edgespec read the weights from the mapped file
(edgespec/memory/filebacked.py). On a machine with free RAM the file then sits in the page
cache and every pass re-maps it from RAM; on a device it does not fit, and every pass reads it
from storage. This script measures the second case on any Linux machine, as root:

    .venv/bin/python benchmarks/filebacked/cgroup_bench.py --limit 600MiB --prompts 2 \\
        --max-tokens 128 --configs plain,auto,suffix \\
        --out benchmarks/results/filebacked-cgroup-code-edit.json

It makes a memory cgroup (v1 ``memory.limit_in_bytes``, and ``memory.memsw.limit_in_bytes``
when swap is accounted; else v2 ``memory.max`` with ``memory.swap.max`` 0) as a child of the
one it runs in, so whatever limits that one has still apply. The page cache a process in it
fills is charged to it, so model file, KV cache, buffers and interpreter share the limit.

Jobs, each in a fresh interpreter that holds ``--lock`` (other benchmarks on the machine wait):
  curve-resident   verification costs with the weights in RAM (no budget, no cgroup)
  curve-cached     file-backed under the budget, the file in the page cache (no cgroup)
  curve-cgroup     file-backed in the cgroup from a cold cache: `auto`'s calibration, made
                   afresh in ``--home`` (this script's store), where the runs find it
  run              one code-edit request per (prompt, config) in the cgroup, from a cold cache
Before every cgroup job: ``sync; echo 3 > /proc/sys/vm/drop_caches``. Results are appended to
``--out`` as each job ends (``--resume`` skips jobs already there); the summary is rewritten.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

LOCK = "/tmp/edgespec-bench.lock"
CGROUP_NAME = "edgespec-filebacked"
JOB_TIMEOUT_S = 600
# Shown in the summary: the sizes issue #11 asks about, all measured by calibrate's sizes.
CURVE_SIZES = (1, 4, 16, 64)


# -- cgroup (parent, root) ------------------------------------------------------------------------
def _own_cgroup(controller: str | None) -> str:
    """This process's cgroup path in the v1 hierarchy of ``controller`` (None: the v2 one)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        if (controller is None and names == "") or (controller is not None and controller in names.split(",")):
            return path
    raise RuntimeError(f"no {controller or 'v2'} cgroup in /proc/self/cgroup")


def _v2_mount() -> Path | None:
    for line in Path("/proc/self/mounts").read_text().splitlines():
        parts = line.split()
        if parts[2] == "cgroup2":
            return Path(parts[1])
    return None


def make_cgroup(limit: int) -> dict:
    """Creates the limited cgroup; returns {"version", "dir", files written}."""
    v1 = Path("/sys/fs/cgroup/memory")
    if (v1 / "memory.limit_in_bytes").exists():
        d = v1 / _own_cgroup("memory").lstrip("/") / CGROUP_NAME
        d.mkdir(exist_ok=True)
        written = {"memory.limit_in_bytes": limit}
        # memsw (memory + swap) may not be set below the memory limit: write it after.
        if (d / "memory.memsw.limit_in_bytes").exists():
            written["memory.memsw.limit_in_bytes"] = limit
        for name, value in written.items():
            (d / name).write_text(str(value))
        return {"version": 1, "dir": str(d), "set": written}
    root = _v2_mount()
    if root is None or "memory" not in (root / "cgroup.controllers").read_text().split():
        raise SystemExit("no memory cgroup controller (neither v1 nor v2) on this machine")
    d = root / _own_cgroup(None).lstrip("/") / CGROUP_NAME
    d.mkdir(exist_ok=True)
    if not (d / "memory.max").exists():
        raise SystemExit(f"{d.parent}: memory is not in cgroup.subtree_control; enable it first")
    written = {"memory.max": limit, "memory.swap.max": 0}
    for name, value in written.items():
        if (d / name).exists():
            (d / name).write_text(str(value))
    return {"version": 2, "dir": str(d), "set": written}


def remove_cgroup(cg: dict) -> None:
    try:
        os.rmdir(cg["dir"])
    except OSError as exc:
        print(f"could not remove {cg['dir']}: {exc}", file=sys.stderr)


# -- child side: runs one job inside the cgroup -----------------------------------------------------
def _drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3")


def _io_read() -> int:
    """Bytes this process caused to be read from storage (page faults on the mapping included)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def _majflt() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_majflt


def _cgroup_stats(cg: dict) -> dict:
    d = Path(cg["dir"])
    if cg["version"] == 1:
        stat = dict(line.split() for line in (d / "memory.stat").read_text().splitlines())
        return {"max_usage_bytes": int((d / "memory.max_usage_in_bytes").read_text()),
                "failcnt": int((d / "memory.failcnt").read_text()),
                **{k: int(stat[k]) for k in ("total_cache", "total_rss", "total_mapped_file",
                                             "total_pgmajfault") if k in stat}}
    stat = dict(line.split() for line in (d / "memory.stat").read_text().splitlines())
    peak = d / "memory.peak"
    return {"max_usage_bytes": int(peak.read_text()) if peak.exists() else None,
            **{k: int(stat[k]) for k in ("file", "anon", "file_mapped", "pgmajfault") if k in stat}}


def _enter(cg: dict | None) -> None:
    """Cold cache, then this process into the cgroup, before anything large is imported."""
    if cg is None:
        return
    _drop_caches()
    d = Path(cg["dir"])
    if cg["version"] == 1:
        (d / "memory.max_usage_in_bytes").write_text("0")  # the peak of this job alone
    (d / "cgroup.procs").write_text(str(os.getpid()))


def child(job: dict) -> dict:
    _enter(job.get("cgroup"))
    if job.get("warm_file"):
        with open(job["model_path"], "rb") as f:  # the page cache holds the whole file
            while f.read(16 << 20):
                pass
    import edgespec  # noqa: F401 - llama.cpp's libraries before numpy's (README)
    from edgespec.bench.machine import describe
    from edgespec.engine import Engine, EngineConfig
    from edgespec.files.store import ModelStore

    store = ModelStore(job["home"])
    cfg = EngineConfig(model=job["model"], n_ctx=job["n_ctx"], n_seq_max=job["draft_max"] + 1,
                       draft=job["draft"], draft_max=job["draft_max"], ram_budget=job["ram_budget"])
    t0, io0 = time.perf_counter(), _io_read()
    with Engine(cfg, store) as engine:
        out = {"load_s": time.perf_counter() - t0, "read_bytes_load": _io_read() - io0,
               "machine": describe(engine.ctx.n_threads),
               "file_backed": engine.load_plan.release_limit is not None,
               "notes": list(engine.load_plan.notes)}
        if job["kind"] == "curve":
            out.update(_curve(engine, job))
        else:
            out.update(_run(engine, job))
        out["weight_releases"] = engine.releaser.releases if engine.releaser else 0
    if job.get("cgroup"):
        out["cgroup"] = _cgroup_stats(job["cgroup"])
    return out


def _curve(engine, job: dict) -> dict:
    from edgespec.drafters.auto.calibrate import measure_verify

    if job["draft"] == "auto":  # calibrated by the engine's load, into this script's store
        return {"batch_sizes": list(engine.drafter.cost.batch_sizes),
                "verify_s": list(engine.drafter.cost.verify_s), "source": "auto calibration"}
    sizes, times = measure_verify(engine.ctx)
    return {"batch_sizes": list(sizes), "verify_s": list(times), "source": "measure_verify"}


def _run(engine, job: dict) -> dict:
    from edgespec.decode.events import DoneEvent, TokenEvent
    from edgespec.decode.loop import Decoder
    from edgespec.decode.request import GenerationRequest
    from edgespec.decode.sampling import SamplingParams

    decoder = Decoder(engine.model, engine.seq) if job["config"] == "plain" else engine.decoder
    tokens = engine.chat_tokens([{"role": "user", "content": job["text"]}])
    request = GenerationRequest(max_tokens=job["max_tokens"], sampling=SamplingParams(temperature=0.0, seed=0))
    # (seconds since the request began, tokens so far, bytes read from storage so far)
    timeline, n, t0, io0, flt0 = [], 0, time.perf_counter(), _io_read(), _majflt()
    done = None
    for ev in decoder.stream(tokens, request):
        if isinstance(ev, TokenEvent):
            n += len(ev.token_ids)
            timeline.append((round(time.perf_counter() - t0, 4), n, _io_read() - io0))
        elif isinstance(ev, DoneEvent):
            done = ev
    st, spec = done.stats, done.stats.spec
    prefill_read = timeline[0][2] if timeline else 0
    return {"prompt_tokens": st.prompt_tokens, "prefill_s": st.prompt_eval_s, "ttft_s": st.ttft_s,
            "new_tokens": st.generated_tokens, "gen_s": st.gen_s, "tokens_per_s": st.tokens_per_s,
            "target_passes": spec.steps if spec else max(st.generated_tokens - 1, 0),
            "drafted": spec.drafted if spec else 0, "accepted": spec.accepted if spec else 0,
            "peak_rss_bytes": st.peak_rss_bytes, "peak_anon_bytes": st.peak_anon_bytes,
            "process_peak_rss_bytes": st.process_peak_rss_bytes,
            "read_bytes_prefill": prefill_read, "read_bytes_gen": timeline[-1][2] - prefill_read if timeline else 0,
            "majflt": _majflt() - flt0, "finish_reason": st.finish_reason, "text": done.text,
            "timeline": timeline}


# -- parent ------------------------------------------------------------------------------------------
def _model_home(home: Path, model_path: Path) -> None:
    """This script's store: the target hard-linked in, calibration its own."""
    dst = home / "models" / model_path.name
    dst.parent.mkdir(parents=True, exist_ok=True)
    if not dst.exists():
        os.link(model_path, dst)
    stamp = model_path.with_name(model_path.name + ".sha256")
    if stamp.exists():
        shutil.copyfile(stamp, dst.with_name(dst.name + ".sha256"))


def _inputs(args) -> dict:
    """Budget, model file and prompts, read by a short-lived interpreter: importing edgespec maps
    llama.cpp's libraries, and pages this process maps stay cached (and uncharged) for the jobs."""
    code = ("import json, sys; from edgespec.bench.prompts import load_suite, select; "
            "from edgespec.files.store import ModelStore; from edgespec.units import parse_bytes; "
            "print(json.dumps({'limit': parse_bytes(sys.argv[1]), 'model_path': str(ModelStore().resolve(sys.argv[2])), "
            "'prompts': [vars(p) for p in select(load_suite(sys.argv[3]), int(sys.argv[4]), sys.argv[5])]}))")
    out = subprocess.run([sys.executable, "-c", code, args.limit, args.model, args.suite, str(args.per_category),
                          args.split], capture_output=True,
                         text=True, check=True)
    d = json.loads(out.stdout)
    d["prompts"] = [argparse.Namespace(**p) for p in d["prompts"]]
    return d


def _jobs(args, prompts, model_path: Path, cg: dict) -> list[dict]:
    base = {"model": args.model, "home": str(args.home), "n_ctx": args.ctx, "draft_max": args.draft_max,
            "max_tokens": args.max_tokens, "model_path": str(model_path)}
    jobs = [
        dict(base, key="curve-resident", kind="curve", draft="suffix", ram_budget=None, cgroup=None),
        dict(base, key="curve-cached", kind="curve", draft="suffix", ram_budget=args.limit, cgroup=None,
             warm_file=True),
        dict(base, key="curve-cgroup", kind="curve", draft="auto", ram_budget=args.limit, cgroup=cg),
    ]
    for p in prompts:
        for config in args.configs:
            # plain runs on an engine planned like suffix's (the bench's plain shares its engine)
            jobs.append(dict(base, key=f"run:{config}:{p.id}", kind="run", config=config, id=p.id,
                             category=p.category, text=p.text, draft="suffix" if config == "plain" else config,
                             ram_budget=args.limit, cgroup=cg))
    return jobs


def _summary(results: dict) -> dict:
    curves = {}
    for key, r in results.items():
        if key.startswith("curve-") and "verify_s" in r:
            ms = dict(zip(r["batch_sizes"], r["verify_s"]))
            curves[key] = {n: round(1000 * ms[n], 1) for n in CURVE_SIZES if n in ms}
    runs = [r for k, r in results.items() if k.startswith("run:") and "tokens_per_s" in r]
    by_prompt: dict[str, dict[str, dict]] = {}
    for r in runs:
        by_prompt.setdefault(r["id"], {})[r["config"]] = r
    ratios: dict[str, list[float]] = {}
    same_as_plain: dict[str, int] = {}
    for configs in by_prompt.values():
        plain = configs.get("plain")
        for name, r in configs.items():
            if plain and name != "plain":
                ratios.setdefault(name, []).append(r["tokens_per_s"] / plain["tokens_per_s"])
                same_as_plain[name] = same_as_plain.get(name, 0) + (r["text"] == plain["text"])
    totals = {}
    for r in runs:
        t = totals.setdefault(r["config"], {"tokens": 0, "gen_s": 0.0, "passes": 0, "read_bytes_gen": 0})
        t["tokens"] += r["new_tokens"] - 1
        t["gen_s"] += r["gen_s"]
        t["passes"] += r["target_passes"]
        t["read_bytes_gen"] += r["read_bytes_gen"]
    for t in totals.values():
        t["tokens_per_s"] = t["tokens"] / t["gen_s"] if t["gen_s"] else 0.0
        t["read_mib_per_pass"] = t["read_bytes_gen"] / max(t["passes"], 1) / 2**20
    plain_rate = totals.get("plain", {}).get("tokens_per_s")
    return {"verify_ms": curves,
            "speedup_per_prompt": ratios,
            "same_text_as_plain": same_as_plain,
            "speedup_overall": {c: t["tokens_per_s"] / plain_rate for c, t in totals.items() if plain_rate},
            "totals": totals}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", default="600MiB", help="cgroup memory limit and --ram-budget")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--prompts", type=int, default=2, help="requests: the first N of the selection, in order")
    ap.add_argument("--suite", default="code-edit", help="code-edit (tuning), code-edit-validation or code-edit-test")
    ap.add_argument("--per-category", type=int, default=1, help="requests per category (bench --limit)")
    ap.add_argument("--split", default="tune", help="tune | validate | test | test2 (bench --split)")
    ap.add_argument("--configs", default="plain,auto,suffix")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--draft-max", type=int, default=32)
    ap.add_argument("--jobs", default="curve,run", help="job kinds (curve, run) or keys (curve-cgroup)")
    ap.add_argument("--home", type=Path, default=Path("/tmp/edgespec-filebacked-home"),
                    help="this script's model store (the target hard-linked in; its own calibration)")
    ap.add_argument("--lock", default=LOCK)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--resume", action="store_true", help="skip jobs already in --out")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(Path(args.child).read_text()))))
        return
    if args.out is None:
        ap.error("--out is required")
    if os.geteuid() != 0:
        raise SystemExit("run as root: it creates a cgroup and drops the page cache")
    inputs = _inputs(args)
    args.limit = inputs["limit"]
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    model_path = Path(inputs["model_path"])
    _model_home(args.home, model_path)
    prompts = inputs["prompts"][:args.prompts]
    cg = make_cgroup(args.limit)
    wanted = set(args.jobs.split(","))
    doc = json.loads(args.out.read_text()) if args.resume and args.out.exists() else {}
    results = doc.get("jobs", {})
    doc["settings"] = {"limit_bytes": args.limit, "ram_budget_bytes": args.limit, "model": args.model,
                       "prompts": [p.id for p in prompts], "configs": args.configs, "max_tokens": args.max_tokens,
                       "n_ctx": args.ctx, "draft_max": args.draft_max, "cgroup": cg,
                       "command": "python " + " ".join(sys.argv)}
    try:
        for job in _jobs(args, prompts, model_path, cg):
            if not {job["kind"], job["key"]} & wanted or "error" not in results.get(job["key"], {"error": 1}):
                continue
            if job["key"] == "curve-cgroup":
                shutil.rmtree(args.home / "calibration", ignore_errors=True)  # measure it afresh
            results[job["key"]] = _spawn(job, args)
            doc["jobs"], doc["summary"] = results, _summary(results)
            args.out.write_text(json.dumps(doc, indent=1))
    finally:
        remove_cgroup(cg)
    print(json.dumps(doc.get("summary", {}), indent=1))


def _spawn(job: dict, args) -> dict:
    spec = args.home / "job.json"
    spec.write_text(json.dumps(job))
    print(f"{time.strftime('%H:%M:%S')} {job['key']} ...", file=sys.stderr, flush=True)
    # The lock `flock LOCK cmd` takes (flock(2)), held here rather than by a wrapper process so
    # that a job over its time limit is killed itself, not only the wrapper.
    with open(args.lock, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        t0 = time.time()
        proc = subprocess.run([sys.executable, __file__, "--child", str(spec)], capture_output=True, text=True,
                              timeout=JOB_TIMEOUT_S)
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
        return {"error": proc.stderr[-1000:], "returncode": proc.returncode, **{k: job.get(k) for k in ("config", "id")}}
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    r.update({k: job[k] for k in ("config", "id", "category") if k in job})
    print(f"  {time.time() - t0:.0f} s: " + ", ".join(f"{k} {r[k]:.2f}" for k in ("load_s", "tokens_per_s", "gen_s")
                                                      if isinstance(r.get(k), float)), file=sys.stderr, flush=True)
    return r


if __name__ == "__main__":
    main()
