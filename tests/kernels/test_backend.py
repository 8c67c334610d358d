"""The switch really switches: under `interpret` (and `pallas`) every public kernel function stages a
pallas_call, under `reference` none does, so the kernel-vs-reference tests never compare the
reference with itself."""

from __future__ import annotations

import functools

import jax
import pytest

from jeagle.kernels.assign_req_to_token_pool import assign_req_to_token_pool
from jeagle.kernels.backend import backend
from jeagle.kernels.build_tree import build_tree
from jeagle.kernels.commit_slots import commit_slots
from jeagle.kernels.settings import KernelSettings, use
from jeagle.kernels.tree_speculative_sampling import tree_speculative_sampling
from jeagle.kernels.verify_tree_greedy import verify_tree_greedy
from tests.kernels.trees import assign_inputs, commit_inputs, random_drafts, random_sampling_inputs, random_trees


def calls():
    tree, steps = random_trees(3, 8, 4, seed=0)
    samp, _ = random_sampling_inputs(3, 8, 4, 37, seed=0)
    drafts, depth = random_drafts(3, 8, 4, seed=0)
    return {"verify_tree_greedy": (functools.partial(verify_tree_greedy, num_spec_steps=steps), tree),
            "tree_speculative_sampling": (functools.partial(tree_speculative_sampling, num_spec_steps=steps), samp),
            "build_tree": (functools.partial(build_tree, max_depth=depth), drafts),
            "commit_slots": (commit_slots, commit_inputs(3, 8, 0)),
            "assign_req_to_token_pool": (assign_req_to_token_pool, assign_inputs(3, 0))}


@pytest.mark.parametrize("name", list(calls()))
@pytest.mark.parametrize("mode", ["interpret", "reference"])
def test_the_switch_picks_the_path(name, mode):
    fn, args = calls()[name]
    # A fresh function object: make_jaxpr caches traces by function, and the switch is read at trace time.
    with use(KernelSettings(backend=mode)):
        staged = "pallas_call" in str(jax.make_jaxpr(lambda *a: fn(*a))(*args))
    assert staged == (mode == "interpret")


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="kernel backend 'cuda'"):
        KernelSettings(backend="cuda")


def test_the_switch_reads_the_settings_in_use(monkeypatch):
    monkeypatch.setenv("JEAGLE_KERNELS", "interpret")  # ignored: only KernelSettings.from_env reads it
    assert backend() == KernelSettings().resolved() == ("pallas" if jax.default_backend() == "gpu" else "reference")
    with use(KernelSettings(backend="interpret")):
        assert backend() == "interpret"
        with use(KernelSettings(backend="reference")):
            assert backend() == "reference"
        assert backend() == "interpret"
