"""A round's phases reach the profile: the named scopes of `jeagle/speculative/round.py` survive XLA's optimization
(every phase names some instruction of the compiled round), the optimized-HLO parser of `bench/common.py`
maps fused and called computations, and trace events join to phases through their `hlo_op` args
(`bench/profile_decode.py --phases`)."""

from __future__ import annotations

import collections
import gzip
import json
import tempfile
from pathlib import Path

import jax
import pytest

from bench.common import PhaseMap, device_events_by_device, hlo_phases, parse_hlo, trace_events
from jeagle.engine import EngineConfig, speculative
from jeagle.sampling import SamplingParams
from jeagle.speculative.round import PHASES, SpecConfig
from tests.spec_models import bigram_target, signed_identity_head, target_config

# A hand-written optimized module: a fusion whose own metadata has no scope (its fused instructions
# do, mostly draft_step), a while whose body holds an unnamed copy (inherits the while's phase), a call
# with no metadata, instructions without metadata outside (a fusion an XLA pass made: its users' phase),
# ops outside every scope.
HLO = """HloModule jit_round_step, is_scheduled=true, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

%fused_computation.1 (param_0.1: f32[4]) -> f32[4] {
  %param_0.1 = f32[4]{0} parameter(0)
  %sine.1 = f32[4]{0} sine(%param_0.1), metadata={op_name="jit(round_step)/draft_step/sin" stack_frame_id=3}
  %cosine.1 = f32[4]{0} cosine(%sine.1), metadata={op_name="jit(round_step)/draft_step/cos"}
  ROOT %add.1 = f32[4]{0} add(%sine.1, %cosine.1), metadata={op_name="jit(round_step)/draft_topk/add"}
}

%body.2 (p.2: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p.2 = (s32[], f32[4]{0}) parameter(0)
  %gte.1 = f32[4]{0} get-tuple-element(%p.2), index=1
  %copy.3 = f32[4]{0} copy(%gte.1)
  %gte.0 = s32[] get-tuple-element(%p.2), index=0
  ROOT %tuple.1 = (s32[], f32[4]{0}) tuple(%gte.0, %copy.3)
}

%cond.2 (p.3: (s32[], f32[4])) -> pred[] {
  %p.3 = (s32[], f32[4]{0}) parameter(0)
  ROOT %constant.9 = pred[] constant(false)
}

%called.4 (x.4: f32[4]) -> f32[4] {
  %x.4 = f32[4]{0} parameter(0)
  ROOT %negate.4 = f32[4]{0} negate(%x.4), metadata={op_name="jit(round_step)/commit/neg"}
}

%fused_computation.5 (p.5: f32[4]) -> f32[4] {
  %p.5 = f32[4]{0} parameter(0)
  ROOT %dot.5 = f32[4]{0} multiply(%p.5, %p.5)
}

ENTRY %main.9 (a.1: f32[4]) -> f32[4] {
  %a.1 = f32[4]{0} parameter(0), metadata={op_name="a"}
  %loop_sine_fusion.1 = f32[4]{0} fusion(%a.1), kind=kLoop, calls=%fused_computation.1, metadata={op_name="jit(round_step)/add"}
  %constant.1 = s32[] constant(0)
  %tuple.0 = (s32[], f32[4]{0}) tuple(%constant.1, %loop_sine_fusion.1)
  %while.2 = (s32[], f32[4]{0}) while(%tuple.0), condition=%cond.2, body=%body.2, metadata={op_name="jit(round_step)/verify_forward/while"}
  %gte.9 = f32[4]{0} get-tuple-element(%while.2), index=1
  %call.4 = f32[4]{0} call(%gte.9), to_apply=%called.4
  %ynn_fusion.5 = f32[4]{0} fusion(%call.4), kind=kCustom, calls=%fused_computation.5
  %convert.6 = f32[4]{0} convert(%ynn_fusion.5), metadata={op_name="jit(round_step)/draft_extend/convert_element_type"}
  ROOT %multiply.9 = f32[4]{0} multiply(%convert.6, %convert.6), metadata={op_name="jit(round_step)/accept_later/mul"}
}
"""


def test_parse_hlo_maps_fused_and_called_computations():
    module, entry, comps, instrs = parse_hlo(HLO)
    assert (module, entry) == ("jit_round_step", "main.9")
    assert set(comps) == {"fused_computation.1", "body.2", "cond.2", "called.4", "fused_computation.5", "main.9"}
    op_name, calls, operands = instrs["loop_sine_fusion.1"]
    assert (op_name, calls, operands[0]) == ("jit(round_step)/add", ["fused_computation.1"], "a.1")
    assert instrs["while.2"][1] == ["cond.2", "body.2"]
    module, phases = hlo_phases(HLO, PHASES)
    assert phases["sine.1"] == "draft_step" and phases["add.1"] == "draft_topk"  # their own op_names
    assert phases["loop_sine_fusion.1"] == "draft_step"  # no scope of its own: most fused instructions'
    assert phases["while.2"] == "verify_forward"
    assert phases["copy.3"] == phases["constant.9"] == "verify_forward"  # unnamed, inside the while: its phase
    assert phases["call.4"] == phases["x.4"] == "commit"  # a call without metadata: its computation's
    assert phases["ynn_fusion.5"] == phases["dot.5"] == "draft_extend"  # no metadata at all: its user's
    assert phases["gte.9"] == "commit" and phases["tuple.0"] == phases["constant.1"] == "verify_forward"
    assert phases["multiply.9"] == phases["a.1"] == "other"  # metadata, no scope ("accept_later" is none)
    pm = PhaseMap([HLO], PHASES)
    assert pm("whatever", {"hlo_op": "copy.3", "hlo_module": "jit_round_step"}) == "verify_forward"
    assert pm("loop_sine_fusion_1", {}) == "draft_step"  # the kernel name, '.' -> '_'
    assert pm("cutlass_gemm", {"hlo_module": "jit_round_step", "name": "draft_extend/dot_general"}) == "draft_extend"
    assert pm("copy_3", {"hlo_module": "jit_spec_prefill_step"}) == "unattributed"  # another executable's
    assert pm("nvjet_sm90", {}) == "unattributed"
    assert pm("k", {"hlo_op": "multiply.9;negate.4", "hlo_module": "jit_round_step"}) == "commit"  # nested: scoped
    events = [("k", 2.0, 0.0, "jit_round_step", {"hlo_op": "sine.1", "hlo_module": "jit_round_step"}),
              ("k", 3.0, 5.0, "jit_round_step", {"hlo_op": "negate.4", "hlo_module": "jit_round_step"}),
              ("x", 1.0, 9.0, "", {})]
    assert pm.busy_us(events) == {"draft_step": (1, 2.0), "commit": (1, 3.0), "unattributed": (1, 1.0)}


def test_gpu_trace_events_carry_their_args(tmp_path: Path):
    """A GPU trace as XLA writes one (kernels on a "/device:GPU:0" process, their args from the thunk's
    annotation): `device_events_by_device(..., with_args=True)` hands the args on, the phases sum them."""
    gpu = {"hlo_module": "jit_round_step", "correlation_id": "7"}
    events = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}},
              {"ph": "X", "pid": 1, "tid": 1, "name": "loop_sine_fusion_1", "ts": 10, "dur": 4,
               "args": {**gpu, "hlo_op": "loop_sine_fusion.1", "name": "add"}},
              {"ph": "X", "pid": 1, "tid": 1, "name": "memcpy", "ts": 20, "dur": 1,
               "args": {**gpu, "hlo_op": "while.2"}},
              {"ph": "X", "pid": 2, "tid": 1, "name": "host work", "ts": 0, "dur": 50, "args": {"hlo_op": "copy.3"}}]
    folder = tmp_path / "plugins" / "profile" / "run"
    folder.mkdir(parents=True)
    with gzip.open(folder / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    ev = device_events_by_device(str(tmp_path), with_args=True)["/device:GPU:0"]
    assert [e[:4] for e in ev] == [("loop_sine_fusion_1", 4.0, 10.0, "jit_round_step"),
                                   ("memcpy", 1.0, 20.0, "jit_round_step")]
    assert PhaseMap([HLO], PHASES).busy_us(ev) == {"draft_step": (1, 4.0), "verify_forward": (1, 1.0)}
    assert device_events_by_device(str(tmp_path))["/device:GPU:0"] == [("loop_sine_fusion_1", 4.0), ("memcpy", 1.0)]


@pytest.fixture(scope="module")
def engine():
    target = bigram_target(target_config())
    return speculative(target, signed_identity_head(target, +1.0, noise=0.08),
                       EngineConfig(max_batch_size=2, max_context=96, batch_buckets=(2,)), SpecConfig(3, 2, 4))


def round_texts(engine):
    keys = engine.warmup_plan(batch_sizes=[2], prefill_lengths=[8], greedy=(True,))
    engine.warmup(batch_sizes=[2], prefill_lengths=[8], greedy=(True,), progress=False)
    return {k.label: engine.executables.get(k).as_text() for k in keys}


def test_every_phase_survives_optimization(engine):
    """Every phase names instructions of the compiled round (so its scope was not lost in lowering or
    optimization), and the prefill, which runs no round, has none of them: the check can fail."""
    texts = round_texts(engine)
    rounds = [t for label, t in texts.items() if label.startswith("round")]
    assert rounds, sorted(texts)
    for text in rounds:
        module, phases = hlo_phases(text, PHASES)
        assert module == "jit_round_step"
        counts = collections.Counter(phases.values())
        assert not [p for p in PHASES if not counts[p]], counts
        assert counts["other"] < len(phases) / 4, counts  # most of the round sits in some phase
    for label, text in texts.items():
        if label.startswith("spec_prefill"):
            assert set(hlo_phases(text, PHASES)[1].values()) == {"other"}, label


def test_trace_events_join_to_phases(engine):
    """A CPU trace's thunk events (host threads; `hlo_op` / `hlo_module` args, as a GPU kernel's) of the
    round executable all find their instruction's phase."""
    texts = round_texts(engine)
    pm = PhaseMap(texts.values(), PHASES)
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            engine.generate([[5, 6, 7], [9, 10]], sp)
        events = [e for e in trace_events(d) if e.get("ph") == "X" and "hlo_op" in (e.get("args") or {})]
    rounds = [e for e in events if e["args"]["hlo_module"] == "jit_round_step"]
    assert rounds, collections.Counter(e["args"]["hlo_module"] for e in events)
    phases = collections.Counter(pm(e["name"], e["args"]) for e in rounds)
    assert not phases["unattributed"], [e["args"] for e in rounds if pm(e["name"], e["args"]) == "unattributed"][:5]
    assert {"draft_step", "verify_forward", "accept", "commit"} <= set(phases), phases
    assert phases["other"] < len(rounds) / 10, phases  # outside every scope: the rows' gather, little else
