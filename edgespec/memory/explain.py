"""Why the plan is what it is: one small function per decision, each stating its reason.

``build_plan`` turns the winning candidate of the plan search (edgespec.memory.planner) into a
Plan whose ``decisions`` say, for every setting, what was chosen and why — with the cost of the
alternative ("an f16 cache would need 1.2 GiB of RAM with the rest of this plan") where the
search had one.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from edgespec.llama.kernels import op_offload_min_batch
from edgespec.memory import placements
from edgespec.memory.footprint import ModelFootprint
from edgespec.memory.machine import MachineInfo, default_threads
from edgespec.memory.candidates import (SUFFIX_BYTES_PER_TOKEN, SUFFIX_DEFAULT_CAP, UBATCH_CHOICES, Decision,
                                        Evaluation, Evaluator, Plan, ShapeChoice, ctx_options, fmt_bytes)


@dataclass
class _Context:
    """What every decision function may read, and where it adds warnings."""

    pl: Evaluator
    e: Evaluation
    evals: list[Evaluation]
    target: ModelFootprint
    drafter: ModelFootprint | None
    m: MachineInfo
    warnings: list[str] = field(default_factory=list)

    def alt(self, **change) -> str:
        """The cost of this plan with one setting changed, for a decision's reason."""
        cfg = replace(self.e.cfg, **change)
        other = next((x for x in self.evals if x.cfg == cfg), None) or self.pl.evaluate(cfg)
        s = f"would need {fmt_bytes(other.ram)} of RAM with the rest of this plan"
        if other.vram:
            s += f" and {fmt_bytes(other.vram)} of VRAM"
        return s + f" (budget {fmt_bytes(self.pl.ram_budget)})"


def build_plan(pl: Evaluator, e: Evaluation, evals: list[Evaluation], target: ModelFootprint,
               drafter: ModelFootprint | None, m: MachineInfo, ram_given: bool, vram_given: bool,
               n_ctx: int | None, mlock: bool, threads: int | None, forced: str | None,
               choice: ShapeChoice) -> Plan:
    c = _Context(pl, e, evals, target, drafter, m)
    cfg, tc = e.cfg, e.target_ctx
    use_mlock, mlock_decision = _mlock(c, mlock)
    n_thr = threads or default_threads(m)
    no_host, op_offload = placements.target_flags(e.ngl, m.gpu_offload)
    decisions = (_budgets(c, ram_given, vram_given) + [_placement(c, forced), _gpu_layers(c, vram_given)] + _weights(c)
                 + [mlock_decision] + _context(c, n_ctx) + _drafters(c) + [_drafts(c, choice)]
                 + [_threads(c, threads, n_thr)])
    return Plan(
        target=target.name, drafter=drafter.name if drafter is not None and cfg.drafter != "none" else None,
        n_ctx=cfg.n_ctx, n_ctx_train=target.n_ctx_train, n_batch=tc.n_batch, n_ubatch=tc.n_ubatch,
        n_seq_max=tc.n_seq, kv_type=cfg.kv_type, flash_attn=tc.flash_attn, n_gpu_layers=e.ngl,
        weights_mode="resident" if cfg.resident else "file-backed", use_mmap=e.use_mmap,
        repack=cfg.repack and e.repack_active, use_mlock=use_mlock, drafter_placement=cfg.drafter,
        placement=cfg.placement, no_host=no_host, op_offload=op_offload, graph_sizes=e.graph_sizes,
        drafter_n_gpu_layers=e.drafter_ngl, drafter_use_mmap=e.drafter_mmap,
        drafter_repack=e.drafter_repack,
        suffix_drafter=bool(cfg.suffix_cap), suffix_cap_tokens=cfg.suffix_cap,
        draft_max=choice.shape.draft_max, draft_tree=choice.shape.tree,
        threads=n_thr, threads_batch=n_thr, ram_budget=pl.ram_budget, vram_budget=pl.vram_budget,
        ram_bytes=e.ram, vram_bytes=e.vram, file_backed_bytes=e.file_bytes, parts=e.parts,
        decisions=decisions, llama_cpp_reports=_reports(e, target), warnings=c.warnings,
    )


def _budgets(c: _Context, ram_given: bool, vram_given: bool) -> list[Decision]:
    m, pl = c.m, c.pl
    out = [Decision("ram_budget", fmt_bytes(pl.ram_budget), "given" if ram_given else
                    f"{fmt_bytes(m.ram_available)} available (free + reclaimable cache) of "
                    f"{fmt_bytes(m.ram_total)}, minus a margin of 5% of the total (at least 256 MiB)")]
    if m.gpus:
        why = "given" if vram_given else (
            "unified memory: the GPU draws on the same RAM, so the RAM budget bounds both" if m.unified_memory
            else f"{fmt_bytes(m.gpus[0].memory_free)} free on {m.gpus[0].name} minus a margin")
        out.append(Decision("vram_budget", fmt_bytes(pl.vram_budget), why))
    return out


def _placement(c: _Context, forced: str | None) -> Decision:
    cfg, e = c.e.cfg, c.e
    mode = cfg.mode
    if forced:
        return Decision("placement", cfg.placement, f"forced (--placement): {mode.help}")
    if not c.pl.gpu:
        why = placements.unavailable(c.m).get("gpu") or "no VRAM budget"
        return Decision("placement", cfg.placement, f"{mode.help}; no GPU placement: {why}")
    if cfg.placement == "gpu":
        why = "the whole target fits in the VRAM budget"
    elif cfg.placement == "offload":
        why = (f"{e.ngl} of {c.target.n_layer + 1} target layers fit in the VRAM budget"
               + (" beside the drafter" if e.drafter_ngl else ""))
    elif cfg.placement == "draft-gpu":
        why = "not one target layer fits in the VRAM the drafter leaves"
    else:
        why = "nothing fits in the VRAM budget"
    return Decision("placement", cfg.placement, f"{mode.help}: {why}")


def _gpu_layers(c: _Context, vram_given: bool) -> Decision:
    m, e, pl, target = c.m, c.e, c.pl, c.target
    if not m.gpu_offload or not m.gpus:
        why = "this llama.cpp build has no GPU offload (CPU-only)" if not m.gpu_offload else \
            "llama.cpp reports no GPU device"
        if vram_given:
            c.warnings.append("--vram-budget ignored: " + why)
        return Decision("n_gpu_layers", 0, why)
    if not e.cfg.resident:
        return Decision("n_gpu_layers", 0, "file-backed weights stay on the CPU")
    if e.ngl == 0:
        return Decision("n_gpu_layers", 0, f"the {e.cfg.placement} placement keeps the target on the CPU")
    if e.ngl == target.n_layer + 1:
        return Decision("n_gpu_layers", e.ngl, f"all {target.n_layer} blocks and the output head fit in "
                        f"{fmt_bytes(pl.vram_budget)} of VRAM ({fmt_bytes(e.vram)} planned)")
    nxt = pl._gpu_need(target, e.target_ctx, e.ngl + 1, True)
    return Decision("n_gpu_layers", e.ngl, f"one more layer would need {fmt_bytes(nxt)} of VRAM, over the "
                    f"budget {fmt_bytes(pl.vram_budget)}; the other layers run on the CPU")


def _weights(c: _Context) -> list[Decision]:
    """Resident or file-backed, mmap or full load, repacked or not."""
    cfg = c.e.cfg
    if cfg.resident:
        mode = Decision("weights", "resident",
                        f"the weights ({fmt_bytes(c.target.weights_bytes)}) fit in RAM with the rest of the plan")
    else:
        res_min = min((x.ram for x in c.evals if x.cfg.resident and x.cfg.n_ctx == cfg.n_ctx), default=0)
        mode = Decision("weights", "file-backed",
                        f"fully resident weights would need at least {fmt_bytes(res_min)} of RAM with the "
                        f"leanest settings (budget {fmt_bytes(c.pl.ram_budget)}): the weights stay in the "
                        "mapped file and only a working set of about two layers plus the output head is "
                        "kept resident; decoding will be bound by storage reads")
    return [mode, _load(c), _repack(c)]


def _load(c: _Context) -> Decision:
    e, cfg = c.e, c.e.cfg
    pinned = placements.pins_split_target(e.ngl, c.target.n_layer, c.m)
    if e.use_mmap:
        why = "weights are mapped from the file: shared with the page cache, loaded on demand"
        if not cfg.resident:
            why = "file-backed weights need the mapping (pages are dropped and re-read)"
        elif e.repack_active:
            why = f"forced: note that mmap + repacking keeps both copies resident (+{fmt_bytes(e.repack_bytes)})"
        elif pinned:
            why = ("forced: note that op offload then copies the CPU layers' weights from mapped pages, "
                   "about 5x slower than from pinned memory")
            c.warnings.append(f"the split target's CPU weights are mapped (forced): every verification of "
                              f"{op_offload_min_batch()}+ tokens copies them to the GPU from pageable memory")
        return Decision("load", "mmap", why)
    if pinned:
        return Decision("load", "pinned host buffers (no mmap)",
                        f"op offload copies the CPU-resident weights to the GPU for every batch of "
                        f"{op_offload_min_batch()}+ tokens, by DMA from pinned memory instead of through the "
                        "driver's staging of mapped pages")
    if not c.m.mmap_supported:
        return Decision("load", "full load", "this llama.cpp build cannot mmap")
    if e.repack_active:
        return Decision("load", "full load (no mmap)",
                        f"llama.cpp repacks {fmt_bytes(e.repack_bytes)} of the weights for this CPU; with mmap "
                        f"the mapped originals would stay resident as well (+{fmt_bytes(e.repack_bytes)}), "
                        "a full load reads them straight into the repacked buffer")
    return Decision("load", "full load (no mmap)", "forced")


def _repack(c: _Context) -> Decision:
    e, cfg, m = c.e, c.e.cfg, c.m
    repack_all = c.target.repack_bytes(m.cpu_features)
    if repack_all == 0:
        build = "build supports repacking" if "REPACK" in m.cpu_features else "build without repacking"
        return Decision("repack", False, f"no weight of this model has an interleaved kernel on this CPU ({build})")
    if cfg.repack and not c.pl.target_repack(cfg):
        return Decision("repack", False, "exact mode: repacked kernels compute a row differently in batches "
                        "of 4+ (edgespec.llama.invariant); the drafter's weights, which do not decide the "
                        "answer, are repacked")
    if cfg.repack:
        return Decision("repack", True, f"{fmt_bytes(e.repack_bytes)} of weights use the faster interleaved "
                        "CPU kernels (llama.cpp's CPU_REPACK buffer, use_extra_bufts)")
    if not cfg.resident:
        why = "file-backed weights must stay in the file: a repacked copy would be anonymous memory"
    else:
        why = f"disabled; with it the plan {c.alt(repack=True)}" if c.pl.force_repack is None else "forced off"
    return Decision("repack", False, why + f" (repacking costs {fmt_bytes(repack_all)})")


def _mlock(c: _Context, mlock: bool) -> tuple[bool, Decision]:
    m, e = c.m, c.e
    if not mlock:
        return False, Decision("mlock", False, "not requested")
    if not e.cfg.resident:
        c.warnings.append("mlock ignored: file-backed weights")
        return False, Decision("mlock", False, "requested, but file-backed weights must stay evictable")
    if not m.mlock_supported:
        c.warnings.append("mlock ignored: not supported by the llama.cpp build")
        return False, Decision("mlock", False, "requested, but this llama.cpp build cannot lock memory")
    locked = sum(p.bytes for p in e.parts if p.where == "RAM" and "weights" in p.component)
    if m.privileged or m.memlock_limit is None or m.memlock_limit >= locked:
        return True, Decision("mlock", True, f"requested; locks {fmt_bytes(locked)} of weights (the limit allows it)")
    c.warnings.append("mlock ignored: RLIMIT_MEMLOCK too low")
    return False, Decision("mlock", False, f"requested, but RLIMIT_MEMLOCK is {fmt_bytes(m.memlock_limit)} < "
                           f"{fmt_bytes(locked)} of weights; raise it (ulimit -l) to lock")


def _context(c: _Context, n_ctx: int | None) -> list[Decision]:
    """Context size, KV cache type, attention kernel and micro-batch."""
    cfg, tc, target = c.e.cfg, c.e.target_ctx, c.target
    if n_ctx is not None:
        ctx = Decision("n_ctx", cfg.n_ctx, f"requested (trained context {target.n_ctx_train})")
    else:
        top = ctx_options(None, target.n_ctx_train)[0]
        ctx = Decision("n_ctx", cfg.n_ctx, f"engine default (trained context {target.n_ctx_train})"
                       if cfg.n_ctx == top else f"capped: a {top}-token context {c.alt(n_ctx=top)}")
    if cfg.kv_type == "f16":
        kv = Decision("kv_type", "f16", f"full precision fits ({fmt_bytes(tc.kv_bytes)} for {tc.n_cells} cells)")
    elif len({x.cfg.kv_type for x in c.evals}) > 1:
        kv = Decision("kv_type", cfg.kv_type, f"{fmt_bytes(tc.kv_bytes)}; an f16 cache {c.alt(kv_type='f16')}"
                      "; quantized caches need flash attention (on)")
    else:
        kv = Decision("kv_type", cfg.kv_type, "requested; quantized caches need flash attention (on)")
    if c.pl.force_flash_attn is not None:
        why = "requested"
    elif tc.flash_attn and cfg.kv_type != "f16":
        why = "required by the quantized V cache"
    elif tc.flash_attn and not cfg.target_on_gpu:
        why = "edgespec's CPU attention: a verified row keeps a one-token decode's bits"
    elif tc.flash_attn:
        why = "llama.cpp's default on GPUs"
    else:
        why = ("off on the CPU with an f16 cache: verification batches measured 15-20% slower with it "
               "(edgespec.llama.kernels.default_flash_attn)")
    fa = Decision("flash_attn", tc.flash_attn, why)
    if cfg.n_ubatch == UBATCH_CHOICES[0] or len({x.cfg.n_ubatch for x in c.evals}) == 1:
        ub = Decision("n_ubatch", tc.n_ubatch, f"prefill in batches of {tc.n_batch}; compute buffer "
                      f"{fmt_bytes(tc.compute_bytes)} touched, {fmt_bytes(tc.compute_reserved)} reserved by llama.cpp")
    else:
        ub = Decision("n_ubatch", tc.n_ubatch, f"smaller micro-batches shrink the compute buffer to "
                      f"{fmt_bytes(tc.compute_bytes)}; n_ubatch 512 {c.alt(n_ubatch=512)}; only prefill gets slower")
    return [ctx, kv, fa, ub]


def _drafters(c: _Context) -> list[Decision]:
    cfg, drafter = c.e.cfg, c.drafter
    if drafter is not None:
        out = [_drafter_model(c)]
    elif c.pl.external is not None:
        out = [Decision("drafter", "outside llama.cpp", "its own runtime (e.g. onnxruntime), counted in the parts above")]
    else:
        out = [Decision("drafter", "none", "no drafter model for this target (or not requested)")]
    if cfg.suffix_cap == SUFFIX_DEFAULT_CAP:
        out.append(Decision("suffix_cap", cfg.suffix_cap, "default history of earlier requests (~"
                            f"{fmt_bytes(SUFFIX_BYTES_PER_TOKEN * cfg.suffix_cap)})"))
    elif cfg.suffix_cap:
        out.append(Decision("suffix_cap", cfg.suffix_cap, f"reduced: the default cap {c.alt(suffix_cap=SUFFIX_DEFAULT_CAP)}"))
    return out


def _drafter_model(c: _Context) -> Decision:
    cfg, name = c.e.cfg, c.drafter.name
    if cfg.drafter == "gpu":
        beside = {"gpu": "the whole target", "offload": f"{c.e.ngl} target layers"}.get(cfg.placement, "the CPU's target")
        return Decision("drafter", "GPU", f"{name} fits in VRAM next to {beside} ({cfg.placement} placement)")
    if cfg.drafter == "cpu":
        why = f"{name} runs on the CPU next to the target (target + drafter fit the RAM budget)"
        return Decision("drafter", "CPU", why + ("; it does not fit in VRAM next to the target" if c.pl.gpu else ""))
    fitting = [x for x in c.evals if x.fits and x.cfg.drafter != "none"]
    if fitting:
        best = min(fitting, key=lambda x: (x.penalty, x.ram))
        return Decision("drafter", "none (suffix drafter only)" if cfg.suffix_cap else "none",
                        f"a plan with {name} fits ({best.cfg.placement}, {best.ngl} target layers on the GPU) "
                        "but ranks lower: its VRAM is worth more as target layers (RANKING)")
    with_d = [x.ram for x in c.evals if x.cfg.drafter != "none" and x.cfg.n_ctx == cfg.n_ctx]
    need = f"the smallest plan with {name} needs {fmt_bytes(min(with_d))} of RAM" if with_d else \
        f"{name} cannot be placed"
    why = (f"the target's weights are file-backed, so a drafter model is out of reach ({need})"
           if not cfg.resident else f"{need} (budget {fmt_bytes(c.pl.ram_budget)})")
    c.warnings.append(f"drafter {name} dropped: it does not fit the budget")
    return Decision("drafter", "none (suffix drafter only)" if cfg.suffix_cap else "none", why)


def _drafts(c: _Context, choice: ShapeChoice) -> Decision:
    """The draft shape: the placement's default, as given, or why the longer one was not taken."""
    shape, cfg, rejected = choice.shape, c.e.cfg, choice.rejected
    value = f"up to {shape.draft_max} tokens" + (", trees (greedy)" if shape.tree else "")
    mode = cfg.mode
    asked = [n for n, v in zip(("--draft-max", "--draft-tree"), choice.asked) if v is not None]
    if rejected is not None:
        why = (f"{rejected.draft_max}-token drafts" + (" and trees" if rejected.tree else "")
               + f" would cost {choice.given_way}")
    elif choice.long_default:
        why = ("the drafter runs on the GPU: a 63-node tree search is cheap and 64 rows verify for about what 32 do"
               if cfg.drafter == "gpu" else "the target verifies through the GPU: 64 rows cost about what 32 do")
    elif mode.long_drafts(cfg.drafter == "gpu"):
        why = "as given" if choice.auto else "63-token drafts and trees are `auto`'s default only"
        asked = [] if choice.auto else asked
    else:
        why = ("it drafts chains ahead during verification" if mode.overlap else
               "the target verifies on the CPU, where 64 rows cost ~20 one-row steps")
    return Decision("drafts", value, why + (f" ({' and '.join(asked)} as given)" if asked else ""))


def _threads(c: _Context, threads: int | None, n_thr: int) -> Decision:
    m = c.m
    why = (f"physical cores ({m.physical_cores} of {m.logical_cores} logical): token generation is memory-bound "
           "and hyper-threads only add contention")
    if m.usable_cpus < m.physical_cores and not threads:
        why = f"the {m.usable_cpus} CPUs this process may use (affinity), fewer than the {m.physical_cores} physical cores"
    if threads:
        why = "requested"
    if c.drafter is not None and c.e.cfg.drafter == "cpu":
        why += "; the drafter takes turns with the target, so both use all of them"
    return Decision("threads", n_thr, why)


def _reports(e: Evaluation, target: ModelFootprint) -> dict:
    """The buffer sizes llama.cpp's log will print for this plan (tests compare them)."""
    tc, dc = e.target_ctx, e.drafter_ctx
    reports = {"target": {"model": target.weights_bytes - (e.repack_bytes if not e.use_mmap else 0),
                          "repack": e.repack_bytes, "kv": tc.kv_bytes, "compute": tc.compute_reserved,
                          "output": tc.output_reported}}
    if dc is not None:
        reports["drafter"] = {"kv": dc.kv_bytes, "compute": dc.compute_reserved, "output": dc.output_reported}
    return reports
