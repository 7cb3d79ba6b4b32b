"""Shared fixtures: real models from the store (pulled on demand), loaded once per session."""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest

from edgespec.llama import invariant
from edgespec.llama.backend import ContextParams, LlamaContext, LlamaModel, ModelParams
from edgespec.files.store import ENV_HOME, ModelStore

TARGET = "qwen2.5-coder-1.5b"
DRAFTER = "qwen2.5-coder-0.5b"
SMALL = "smollm2-135m"
GEMMA = "gemma3-270m"


# Modules none of whose tests load a model into llama.cpp (pure Python and numpy, GGUF files, the
# store's pulls): `make test` runs them on two workers with the rest, with OMP_THREAD_LIMIT=1:
# llama.cpp's OpenMP threads wait at barriers, so two processes of two threads each on a 2-core
# machine slow each other down by orders of magnitude, while two of one thread each do not.
# Each worker runs its model-free tests first (the scheduler below).
MODEL_FREE = {"test_acceptance", "test_plumbing", "test_policy", "test_recheck", "test_replay",
              "test_sampling", "test_suffix_index", "test_text", "test_gguf", "test_store",
              "test_cli_models", "test_tree_search", "test_llama_patches"}
# Modules of both kinds: the tests named here load a model, in this process or in a child
# process (a command, a server, a fresh interpreter); every other test of the module loads none
# (settings, refusals before loading, plans read from GGUF headers, fakes) and is model_free.
# Modules in neither table are wholly real-model tests; test_onnx_convert is one, its checks sharing
# the session's conversion with test_onnx_drafter's (made once, in one process).
MODEL_TESTS = {
    "test_qmatmul": {"test_the_loaded_backend_says_whether_rows_keep_their_bits"},
    "test_auto_select": {"test_engine_loads_the_drafter_only_when_its_calibration_pays",
                         "test_a_planned_load_leaves_out_a_drafter_that_cannot_pay_and_says_so"},
    "test_bench": {"test_short_real_run_json_schema", "test_shared_prefill_evaluates_each_prompt_once",
                   "test_all_turns_share_plain_history", "test_sampled_runs_compare_no_answers_with_plain"},
    "test_bench_peers": {"test_real_llama_cpp_draft_run", "test_real_llama_cpp_ngram_mod_run",
                         "test_real_llama_cpp_plain_run", "test_real_llama_cpp_python_pld_run"},
    "test_budget": {"test_a_budgeted_load_builds_what_the_plan_planned",
                    "test_budget_fitting_target_and_drafter_uses_both",
                    "test_budget_between_target_and_both_drops_the_model_drafter",
                    "test_budget_below_the_weights_runs_file_backed_under_budget",
                    "test_a_planned_load_that_drops_the_drafter_counts_it_where_the_rule_read"},
    "test_cli": {"test_run_json", "test_run_streams_answer_then_stats_line",
                 "test_chat_keeps_history_and_reuses_the_cache", "test_chat_multiline_and_unknown_command",
                 "test_run_with_suffix_drafter_reports_speculation", "test_run_stats_line_shows_drafting"},
    "test_clone": {"test_clone_decodes_finite_logits_in_llama_cpp"},
    "test_code_edit_suite": {"test_prompts_fit_in_qwen_tokens"},
    "test_exact": {"test_probe_sees_default_kernels_depend_on_the_batch",
                   "test_a_context_for_short_drafts_is_probed_with_the_rows_it_verifies",
                   "test_exact_speculation_equals_plain_bit_for_bit",
                   "test_exact_mode_refuses_after_default_kernels_ran", "test_plan_shows_the_exact_load"},
    "test_hostile_cli": {"test_run_with_non_utf8_prompt_system_and_stop", "test_run_with_non_utf8_stdin_and_model_path",
                         "test_chat_keeps_going_after_a_non_utf8_line", "test_tokenize_refuses_lone_surrogates",
                         "test_ctrl_c_during_load_exits_130_promptly"},
    "test_load": {"test_plan_prints_what_the_engine_loads"},
    "test_modelfile": {"test_building_a_budgeted_engine_with_a_drafter_parses_each_file_once"},
    "test_onnx_plumbing": {"test_cuda_on_this_cpu_only_machine_drafts_on_the_cpu_with_one_warning"},
    "test_placements": {"test_a_drafter_wholly_on_the_cpu_never_ships_its_batches_to_the_gpu",
                        "test_a_split_target_reads_its_cpu_weights_into_pinned_host_buffers",
                        "test_drafts_default_to_long_trees_where_the_drafter_is_on_a_gpu",
                        "test_engine_in_the_cpu_placement_loads_what_the_plan_says", "test_vram_decides_the_mode"},
    "test_planner": {"test_a_drafter_planned_without_repacking_is_loaded_without_it",
                     "test_resident_memory_of_a_full_load_matches_the_plan",
                     "test_resident_memory_of_a_small_model_matches_the_plan",
                     "test_target_estimates_match_llama_cpp_reports", "test_estimates_match_what_llama_cpp_reports",
                     "test_target_resident_memory_matches_the_plan"},
    "test_rss": {"test_request_stats_report_the_request_and_the_process_peak"},
    "test_server": {"test_api_key", "test_bad_input_is_typed", "test_raw_http_errors",
                    "test_queue_full_and_disconnect_frees_the_slot", "test_cancel_from_another_thread",
                    "test_concurrent_clients_get_their_own_complete_answers", "test_generate_stream_and_chat",
                    "test_metrics_after_traffic", "test_openai_client_chat_and_completions",
                    "test_queue_full_and_cancel_while_queued", "test_threads_queue_and_get_their_own_answers"},
    "test_server_hostile": {"test_api_key_file_refusals", "test_api_key_from_a_file_or_the_environment",
                            "test_lone_surrogates_and_deep_nesting_are_400", "test_signals_end_the_server_mid_stream",
                            "test_post_needs_a_json_content_type", "test_stalled_and_abandoned_uploads_cost_one_line_each",
                            "test_garbage_and_disconnects_mid_stream"},
    "test_speculative": {"test_cache_equals_fresh_prefill_after_rejections", "test_f32_speculative_greedy_equals_plain",
                         "test_quantized_speculation_drafts_and_diverges_only_at_rare_near_ties",
                         "test_sampling_distribution_is_unchanged"},
    "test_store_faults": {"test_run_in_a_read_only_store_answers_with_one_warning", "test_cli_on_a_corrupted_model"},
    "test_templates_hostile": {"test_control_token_text_in_content_stays_text", "test_engine_chat_tokens_uses_the_split",
                               "test_ordinary_conversations_tokenize_as_before", "test_template_that_rewrites_contents",
                               "test_without_a_template_contents_are_text"},
}
# A model-free test that loads a model fails: in this process LlamaModel refuses while it runs
# (fixtures included, whatever their scope), and its Python child processes get
# tests/model_free_guard/ first on their PYTHONPATH, whose sitecustomize ends a child that loads
# a model with exit code 99.
GUARD_DIR = Path(__file__).with_name("model_free_guard")


# Real-model tests that time signals against a child's progress (a load to interrupt, a stream
# to cut): `make test` runs them alone after the others, which it runs on two workers.
SERIAL = {"test_hostile_cli": {"test_ctrl_c_during_load_exits_130_promptly"},
          "test_server_hostile": {"test_signals_end_the_server_mid_stream"}}
# The modules that hold every `serial` and `gpu` test (checked whenever they are collected with
# the rest): the step that runs those (-m "serial or gpu") collects only these, 3 s sooner.
SERIAL_OR_GPU = "serial or gpu"
SERIAL_OR_GPU_MODULES = {"test_gpu", *SERIAL}


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "serial: a real-model test timed against a child process; "
                                       "`make test` runs these alone (tests/conftest.py SERIAL)")


# Work units of `make test`'s step on two workers (--dist loadgroup): each module's model-free
# tests, and its real-model tests, run whole on one worker, so its module fixtures are made once,
# and the real-model tests of the modules of a group here share one worker for their session
# fixtures: the session's ONNX conversion (onnx_exact, which `--draft onnx` then finds in the
# session's store).
XDIST_GROUPS = {"test_onnx_convert": "onnx", "test_onnx_drafter": "onnx", "test_onnx_plumbing": "onnx",
                "test_onnx_speculative": "onnx"}
# The model-free units are handed out first: a worker then runs every model-free test it gets
# before any real-model test or fixture has loaded a model in that process, where the guard
# below refuses a load. Then these, longest first (on the 2-core VM: ~190, 110, 90, 40, 30, 30,
# 30, 28 s, ... 8 s), for a long unit started last would leave the other worker idle; the rest
# (each a few seconds) follow by number of tests.
MODEL_FREE_UNIT = "model-free:"
HEAVY_UNITS = ("test_speculative", "onnx", "test_exact", "test_budget", "test_server", "test_generate",
               "test_planner", "test_server_soak", "test_cli", "test_bench", "test_store_faults", "test_calibrate",
               "test_server_hostile", "test_auto_select", "test_backend_greedy")


def is_model_free(module: str, name: str) -> bool:
    """Whether test function ``name`` of ``module`` loads no model (MODEL_FREE, MODEL_TESTS)."""
    return module in MODEL_FREE or (module in MODEL_TESTS and name not in MODEL_TESTS[module])


@pytest.hookimpl(optionalhook=True)  # an xdist hook: plain pytest runs without it
def pytest_xdist_make_scheduler(config, log):
    """--dist loadgroup by module and XDIST_GROUPS (xdist's own reads `xdist_group` marks into node
    ids that pytest 9 no longer lets a plugin rename, so it ran every test as its own unit)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path, _, name = nodeid.partition("::")
            module = Path(path).stem
            if is_model_free(module, name.split("[", 1)[0]):
                return MODEL_FREE_UNIT + module
            return XDIST_GROUPS.get(module, module)

        def _assign_work_unit(self, node) -> None:
            first = next((u for u in self.workqueue if u.startswith(MODEL_FREE_UNIT)), None) or \
                next((u for u in HEAVY_UNITS if u in self.workqueue), None)
            if first is not None:
                self.workqueue.move_to_end(first, last=False)
            super()._assign_work_unit(node)

    return UnitScheduling(config, log)


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    if config.getoption("markexpr") == SERIAL_OR_GPU and collection_path.suffix == ".py" \
            and collection_path.stem.startswith("test_") and collection_path.stem not in SERIAL_OR_GPU_MODULES:
        return True
    return None


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(items) -> None:
    for item in items:
        module = item.module.__name__
        if is_model_free(module, item.originalname):
            item.add_marker("model_free")
        if item.originalname in SERIAL.get(module, ()):
            item.add_marker("serial")
        if module not in SERIAL_OR_GPU_MODULES and (item.get_closest_marker("gpu") or item.get_closest_marker("serial")):
            raise pytest.UsageError(f"{item.nodeid} is a serial or gpu test outside SERIAL_OR_GPU_MODULES "
                                    "(tests/conftest.py): the step that runs those would not collect it")


_RUNNING_MODEL_FREE: list[str] = []  # the model_free test running now, if any
_load_model = LlamaModel.__init__


def _guarded_init(self, *args, **kwargs):
    if _RUNNING_MODEL_FREE:
        raise AssertionError(f"{_RUNNING_MODEL_FREE[0]} is model_free (tests/conftest.py) but loads a model")
    _load_model(self, *args, **kwargs)


LlamaModel.__init__ = _guarded_init


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not item.get_closest_marker("model_free"):
        yield
        return
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(GUARD_DIR)] + ([saved] if saved else []))
    _RUNNING_MODEL_FREE[:] = [item.nodeid]
    try:
        yield
    finally:
        _RUNNING_MODEL_FREE.clear()
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


# Build caches and reports kept in the user's store between sessions: the F32 copy of SmolLM2
# costs a minute to build. Nothing else of the user's store is written by the tests.
_SHARED_DIRS = ("test-cache", "test-reports")
_USER_STORE: list[ModelStore] = []  # the user's store, as found before the session's override


@pytest.fixture(scope="session", autouse=True)
def edgespec_home(tmp_path_factory) -> Path:
    """A temporary store home, $EDGESPEC_HOME for the whole session, holding the user's models.

    Built-in models pulled into the user's store ($EDGESPEC_HOME or ~/.cache/edgespec; `make
    test` pulls them) are hard-linked in (symlinked across file systems) with copies of their
    verification stamps, so calibration and anything else a test writes lands here, and `auto`
    calibrates afresh each session instead of trusting an earlier run's numbers.
    """
    _USER_STORE[:] = [ModelStore()]
    user = _USER_STORE[0]
    home = tmp_path_factory.mktemp("edgespec-home")
    for name in user.manifests():
        if user.is_present(name):
            _link_model(user, name, home)
    for name in _SHARED_DIRS:
        (user.home / name).mkdir(parents=True, exist_ok=True)
        (home / name).symlink_to(user.home / name, target_is_directory=True)
    saved = os.environ.get(ENV_HOME)
    os.environ[ENV_HOME] = str(home)
    yield home
    if saved is None:
        os.environ.pop(ENV_HOME, None)
    else:
        os.environ[ENV_HOME] = saved


@pytest.fixture(autouse=True)
def _tiled_matmul_switch():
    """A test that resolves an exact load turns llama.cpp's tiled matmul off for the process
    (edgespec.llama.invariant.enable: a variable its llama.cpp reads at its first matmul, and its
    children inherit): it is put back after the test, so later tests run the default kernels."""
    saved = os.environ.get(invariant.TILED_MM_ENV)
    yield
    if saved is None:
        os.environ.pop(invariant.TILED_MM_ENV, None)
    else:
        os.environ[invariant.TILED_MM_ENV] = saved


@pytest.fixture(scope="session")
def store(edgespec_home) -> ModelStore:
    """The session's store (see edgespec_home)."""
    return ModelStore(edgespec_home)


def _link_model(user: ModelStore, name: str, home: Path) -> None:
    src = user.path_for(name)
    dst = home / "models" / src.name
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        dst.symlink_to(src)
    stamp = src.with_name(src.name + ".sha256")
    if stamp.exists():
        shutil.copyfile(stamp, dst.with_name(dst.name + ".sha256"))


@pytest.fixture(scope="session")
def model_path(store):
    """Factory: path of a named model, pulled into the user's store if missing, then linked."""
    def get(name: str):
        if not store.is_present(name):
            user = _USER_STORE[0]
            logging.getLogger(__name__).warning("pulling %s for the tests", name)
            user.pull(name)
            _link_model(user, name, store.home)
        return store.resolve(name)
    return get


@pytest.fixture(scope="session")
def small_model(model_path) -> LlamaModel:
    """SmolLM2-135M: fast enough to generate hundreds of tokens in a test."""
    return LlamaModel(model_path(SMALL))


@pytest.fixture(scope="session")
def target_model(model_path) -> LlamaModel:
    """The 1.5B target, mapped without its repacked copy (1 s less to load): it is read, not run."""
    return LlamaModel(model_path(TARGET), ModelParams(repack=False))


@pytest.fixture(scope="session")
def onnx_exact(store, model_path):
    """The session's exact ONNX conversion of the drafter, next to its GGUF in the session's
    store, where `--draft onnx` finds it instead of converting again: (store, conversion
    directory). Tests only read it."""
    pytest.importorskip("onnx")
    from edgespec.onnx.convert import convert

    return store, convert(store, model_path(DRAFTER), "exact")


@pytest.fixture
def small_ctx(small_model):
    ctx = LlamaContext(small_model, ContextParams(n_ctx=1024, n_seq_max=4))
    yield ctx
    ctx.close()
