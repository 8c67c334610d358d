"""KernelSettings: the four environment variables are read by `from_env` alone (each value, and the
bad ones refused with the messages they always had); the kernels see only the settings in `use`,
never the environment."""

from __future__ import annotations

import threading

import jax
import pytest

from jeagle.kernels.paged_attention import prefix_splits
from jeagle.kernels.settings import BACKENDS, KernelSettings, current, use

PLATFORM_DEFAULT = "pallas" if jax.default_backend() == "gpu" else "reference"


def test_from_env_of_an_empty_environment_is_the_default():
    assert KernelSettings.from_env({}) == KernelSettings()
    assert KernelSettings().resolved() == PLATFORM_DEFAULT


@pytest.mark.parametrize("mode", BACKENDS)
def test_from_env_backend(mode):
    s = KernelSettings.from_env({"JEAGLE_KERNELS": mode})
    assert s.backend == mode and s.resolved() == mode


@pytest.mark.parametrize("bad", ["cuda", "", "Pallas"])
def test_from_env_refuses_an_unknown_backend(bad):
    with pytest.raises(ValueError, match=r"JEAGLE_KERNELS=.*expected one of \('pallas', 'interpret', 'reference'\)"):
        KernelSettings.from_env({"JEAGLE_KERNELS": bad})


@pytest.mark.parametrize("text,want", [("1", None), ("", "auto"), (" ", "auto"), ("auto", "auto"), (" AUTO ", "auto"),
                                       ("8", 8), ("2", 2)])
def test_from_env_paged_attention_splits(text, want):
    assert KernelSettings.from_env({"JEAGLE_PAGED_ATTENTION_SPLITS": text}).paged_attention_splits == want


@pytest.mark.parametrize("bad", ["0", "-2", "many", "1.5"])
def test_from_env_refuses_bad_splits(bad):
    with pytest.raises(ValueError, match="JEAGLE_PAGED_ATTENTION_SPLITS=.*: expected auto or a count >= 1"):
        KernelSettings.from_env({"JEAGLE_PAGED_ATTENTION_SPLITS": bad})


@pytest.mark.parametrize("text,want", [("1", True), ("0", False), ("true", False), ("", False)])
def test_from_env_triton_gemm(text, want):
    assert KernelSettings.from_env({"JEAGLE_TRITON_GEMM": text}).triton_gemm is want  # only "1" turns it on


SWITCHES = [("JEAGLE_LINEAR", "linear"), ("JEAGLE_TOPK", "topk")]  # kernels on unless turned off


@pytest.mark.parametrize("env,field", SWITCHES)
@pytest.mark.parametrize("text,want", [("1", True), ("0", False), ("off", False), ("", True), (None, True)])
def test_from_env_kernel_switches(env, field, text, want):
    environ = {} if text is None else {env: text}
    assert getattr(KernelSettings.from_env(environ), field) is want


@pytest.mark.parametrize("env,field", SWITCHES)
def test_kernel_switches_refuse_bad_values(env, field):
    with pytest.raises(ValueError, match=f"{env}='maybe': expected 1 or 0"):
        KernelSettings.from_env({env: "maybe"})
    with pytest.raises(ValueError, match=f"{field} must be a bool"):
        KernelSettings(**{field: "yes"})


def test_linear_max_rows_from_env_and_validation():
    assert KernelSettings.from_env({}).linear_max_rows == 64
    assert KernelSettings.from_env({"JEAGLE_LINEAR_MAX_ROWS": "128"}).linear_max_rows == 128
    for bad in ("8", "256", "many"):
        with pytest.raises(ValueError, match=f"JEAGLE_LINEAR_MAX_ROWS='{bad}': expected a count of rows in 16..128"):
            KernelSettings.from_env({"JEAGLE_LINEAR_MAX_ROWS": bad})
    for bad in (8, 129, True, 64.0):
        with pytest.raises(ValueError, match="linear_max_rows"):
            KernelSettings(linear_max_rows=bad)


def test_from_env_xla_options():
    s = KernelSettings.from_env({"JEAGLE_XLA_OPTIONS": '{"xla_gpu_autotune_level": 0, "xla_a": true}'})
    assert s.xla_options == (("xla_a", True), ("xla_gpu_autotune_level", 0))
    assert dict(s.xla_options) == {"xla_gpu_autotune_level": 0, "xla_a": True}
    assert KernelSettings.from_env({"JEAGLE_XLA_OPTIONS": "  "}).xla_options == ()
    hash(s)  # a part of every executable's key


@pytest.mark.parametrize("bad,message", [("{oops", "JEAGLE_XLA_OPTIONS is not JSON"),
                                         ("[1, 2]", "JEAGLE_XLA_OPTIONS must be a JSON object"),
                                         ('{"xla_a": [1]}', "XLA options take a bool, number or string")])
def test_from_env_refuses_bad_xla_options(bad, message):
    with pytest.raises(ValueError, match=message):
        KernelSettings.from_env({"JEAGLE_XLA_OPTIONS": bad})


def test_from_env_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("JEAGLE_KERNELS", "interpret")
    monkeypatch.setenv("JEAGLE_PAGED_ATTENTION_SPLITS", "auto")
    monkeypatch.setenv("JEAGLE_TRITON_GEMM", "1")
    monkeypatch.setenv("JEAGLE_XLA_OPTIONS", '{"xla_a": 1}')
    assert KernelSettings.from_env() == KernelSettings("interpret", "auto", True, (("xla_a", 1),))
    monkeypatch.setenv("JEAGLE_PREFILL_ATTENTION", "gathered")
    assert KernelSettings.from_env().prefill_attention == "gathered"


def test_prefill_attention_choice():
    assert KernelSettings().prefill_attention == KernelSettings.from_env({}).prefill_attention == "paged"
    with pytest.raises(ValueError, match="JEAGLE_PREFILL_ATTENTION='dense'"):
        KernelSettings.from_env({"JEAGLE_PREFILL_ATTENTION": "dense"})
    with pytest.raises(ValueError, match="prefill_attention"):
        KernelSettings(prefill_attention="flash")


def test_validation():
    with pytest.raises(ValueError, match="kernel backend"):
        KernelSettings(backend="triton")
    for bad in (0, -1, "2", "off", True, 1.5):
        with pytest.raises(ValueError, match="paged_attention_splits"):
            KernelSettings(paged_attention_splits=bad)
    with pytest.raises(ValueError, match="triton_gemm"):
        KernelSettings(triton_gemm=1)
    with pytest.raises(ValueError, match="xla_options"):
        KernelSettings(xla_options=(("a", 1), ("a", 2)))
    with pytest.raises(ValueError, match="xla_options"):
        KernelSettings(xla_options=("a", 1))
    assert KernelSettings(paged_attention_splits=1) == KernelSettings(paged_attention_splits=None)  # one run: no split
    assert KernelSettings().paged_attention_splits == "auto"  # the default (measured faster on the H100)
    assert KernelSettings(xla_options={"b": 1, "a": 2}).xla_options == (("a", 2), ("b", 1))


def test_current_ignores_the_environment(monkeypatch):
    monkeypatch.setenv("JEAGLE_KERNELS", "interpret")
    monkeypatch.setenv("JEAGLE_PAGED_ATTENTION_SPLITS", "1")
    monkeypatch.setenv("JEAGLE_TRITON_GEMM", "1")
    monkeypatch.setenv("JEAGLE_XLA_OPTIONS", '{"xla_a": 1}')
    assert current() == KernelSettings()
    assert prefix_splits(1, 3, 2048) == 16  # the default, auto, whatever the environment says


def test_use_nests_and_restores():
    a, b = KernelSettings(backend="interpret"), KernelSettings(backend="reference", paged_attention_splits="auto")
    with use(a) as got:
        assert got is a and current() is a
        with use(b):
            assert current() is b and prefix_splits(1, 3, 2048) == 16
        assert current() is a
    assert current() == KernelSettings()
    with pytest.raises(RuntimeError), use(a):
        raise RuntimeError
    assert current() == KernelSettings()
    with pytest.raises(TypeError):
        with use("interpret"):
            pass


def test_use_is_per_thread():
    seen = []
    with use(KernelSettings(backend="interpret")):
        t = threading.Thread(target=lambda: seen.append(current()))
        t.start()
        t.join()
    assert seen == [KernelSettings()]  # a new thread starts outside any `use`: workers enter their own


def test_slice_fusion_off_turns_xla_dynamic_slice_fusions_off_on_a_gpu_only(monkeypatch):
    """KernelSettings.slice_fusion=False adds XLA's option on a GPU (the user's JEAGLE_XLA_OPTIONS win);
    True adds nothing; a CPU gets no options of ours; the choice is part of the settings' key."""
    from jeagle.runtime.executables import compiler_options

    name = "xla_gpu_enable_dynamic_slice_fusion"
    off = KernelSettings(slice_fusion=False)
    assert off != KernelSettings() and hash(off) != hash(KernelSettings())
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert name not in compiler_options(off, cublas_only=True)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    for cublas_only in (True, False):
        assert compiler_options(off, cublas_only=cublas_only)[name] is False
        assert name not in compiler_options(KernelSettings(), cublas_only=cublas_only)
    assert compiler_options(KernelSettings(slice_fusion=False, deterministic=True), cublas_only=False)[name] is False
    assert compiler_options(KernelSettings(slice_fusion=False, xla_options={name: True}), cublas_only=True)[name] is True
    with pytest.raises(ValueError, match="slice_fusion must be a bool"):
        KernelSettings(slice_fusion="off")


def test_deterministic_compiles_without_autotuning_only_where_xla_carries_the_target(monkeypatch):
    """Deterministic mode on a GPU: cuBLAS for every XLA matmul; no autotuning on the reference backend (its
    jnp form, where XLA's matmuls are the target's), autotuning kept on a kernel backend (the target's
    products and attention are its own kernels); JEAGLE_XLA_OPTIONS still wins."""
    from jeagle.runtime.executables import compiler_options

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    level, triton = "xla_gpu_autotune_level", "xla_gpu_enable_triton_gemm"
    jnp_form = compiler_options(KernelSettings(backend="reference", deterministic=True), cublas_only=False)
    assert jnp_form[level] == 0 and jnp_form[triton] is False
    for backend in ("pallas", None):  # None: the GPU's default, pallas
        kernels = compiler_options(KernelSettings(backend=backend, deterministic=True), cublas_only=False)
        assert level not in kernels and kernels[triton] is False
    mine = KernelSettings(backend="reference", deterministic=True, xla_options={level: 4})
    assert compiler_options(mine, cublas_only=True)[level] == 4


def test_deterministic_compiles_without_excess_precision_on_every_backend(monkeypatch):
    """Deterministic executables round to bf16 where the program does, on a CPU and a GPU alike (which ops a
    fusion holds in fp32 would otherwise follow the layer loop's form); the default mode keeps XLA's default."""
    from jeagle.runtime.executables import compiler_options

    name = "xla_allow_excess_precision"
    for platform in ("cpu", "gpu"):
        monkeypatch.setattr(jax, "default_backend", lambda platform=platform: platform)
        for backend in ("reference", "interpret", "pallas"):
            assert compiler_options(KernelSettings(backend=backend, deterministic=True), cublas_only=False)[name] is False
        assert name not in compiler_options(KernelSettings(), cublas_only=False)
