"""What the bench scripts share: the repository on sys.path, the model shapes they build at random,
prompt loading, the timing loop, trace parsing, and the run's identity (commit, device) and output.

Importing this module puts the repository root on sys.path, so a script run as `python bench/x.py`
(or `python bench/probes/x.py`, which first puts bench/ on the path) can import jeagle, checkpoints_conv
and tests without installing them. Everything here imports JAX lazily: `--help` stays fast.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from jeagle import git_commit  # noqa: E402,F401  (re-exported: the commit every bench records)

SHAPES = {
    # SmolLM2-135M-Instruct
    "smollm2": dict(arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                    num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0, tie_word_embeddings=True,
                    max_position_embeddings=8192, rms_norm_eps=1e-5),
    # Llama-3.1-8B
    "llama8b": dict(arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                    num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0, max_position_embeddings=8192,
                    rms_norm_eps=1e-5),
    # a CPU smoke-test shape for the bench scripts (numbers meaningless)
    "tiny": dict(arch="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=16, rope_theta=10000.0, tie_word_embeddings=True,
                 max_position_embeddings=2048, rms_norm_eps=1e-5),
}


# ---- the run's identity and output ----------------------------------------------------------------------
def device_kind() -> str:
    """The first JAX device's kind ("NVIDIA H100 80GB HBM3"; on CPU the platform)."""
    import jax

    dev = jax.devices()[0]
    return getattr(dev, "device_kind", dev.platform)


def emit(doc: dict, json_out: str | None = None) -> None:
    """Write `doc` to `json_out` (indented) when given, then print it as the last line (one JSON document)."""
    if json_out:
        Path(json_out).write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc))


# ---- prompts --------------------------------------------------------------------------------------------
def read_prompts(path: str | None, fallback: str) -> list[str]:
    """The prompts of a .jsonl file (a "prompt" field per line, or a bare string); [fallback] without one."""
    if not path:
        return [fallback]
    rows = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
    return [r["prompt"] if isinstance(r, dict) else str(r) for r in rows]


def chat_ids(tok, texts: list[str]) -> list[list[int]]:
    """Each text as one user turn through the tokenizer's chat template."""
    return [tok.encode_chat([{"role": "user", "content": t}]) for t in texts]


def prompt_logits(model, ids: list[int], last_only: bool = True):
    """The target's logits over `ids` from one prefill-shaped forward, float64 on the host: the
    next-token logits [V] after `ids` (last_only), else every position's [T, V]."""
    import jax.numpy as jnp
    import numpy as np

    from jeagle.runtime.kv_cache import init_pools
    from jeagle.models.common import AttnInputs

    t = len(ids)
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    k, v = init_pools(model.cfg, num_slots=t + 2)
    attn = AttnInputs(positions=pos, write_slots=pos + 1, kv_slots=pos + 1, kv_len=jnp.asarray([t], jnp.int32))
    out = model(jnp.asarray([ids], jnp.int32), attn, k, v,
                logits_index=jnp.asarray([t - 1], jnp.int32) if last_only else None)
    return np.asarray(out.logits[0], np.float64)


# ---- timing ---------------------------------------------------------------------------------------------
def median_run(fn, repeats: int) -> tuple[float, dict]:
    """fn() -> (new tokens, info); returns (tokens/s, info) of the median run. A dict info gains
    `run_tokens_per_s`: every run's, in order (a slow run among fast ones shows there)."""
    return median_runs({None: fn}, repeats)[None]


def median_runs(fns: dict, repeats: int) -> dict:
    """median_run of each of `fns` ({key: fn}), their runs interleaved (one of each per cycle, so that a
    machine's drift falls on all of them alike): {key: (tokens/s, info)}."""
    runs = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            n, info = fn()
            runs[k].append((n / (time.perf_counter() - t0), info))
    out = {}
    for k, rs in runs.items():
        rates = [round(r, 1) for r, _ in rs]
        tps, info = sorted(rs, key=lambda r: r[0])[len(rs) // 2]
        out[k] = (tps, {**info, "run_tokens_per_s": rates} if isinstance(info, dict) else info)
    return out


# ---- random models of a named shape ---------------------------------------------------------------------
# The draft vocabulary of a shape's random EAGLE-3 head: the shipped SmolLM2 head's 8,192 (its draft top-K
# then takes the same kernel as the real head's), the published 8B heads' 32,000. Until 2026-11-26 every
# shape's random head had min(32000, vocab): SmolLM2 rounds measured before then drafted over 32,000.
DRAFT_VOCAB = {"smollm2": 8192, "llama8b": 32000}


def random_eagle3_head(cfg, seed: int = 1, draft_vocab: int | None = None):
    """A one-layer EAGLE-3 head shaped for `cfg`, its draft vocabulary `draft_vocab` (default: 32k, as
    the published 8B heads, or the target's if smaller)."""
    from jeagle.config import DraftConfig
    from jeagle.models.eagle import random_draft

    n = cfg.num_layers
    return random_draft(DraftConfig(kind="eagle3", hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                                    num_layers=1, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                                    head_dim=cfg.head_dim, vocab_size=cfg.vocab_size,
                                    draft_vocab_size=min(draft_vocab or 32000, cfg.vocab_size),
                                    target_hidden_size=cfg.hidden_size,
                                    aux_layer_ids=(min(2, n - 1), n // 2, max(n - 3, 0)), rope_theta=cfg.rope_theta,
                                    rms_norm_eps=cfg.rms_norm_eps), seed=seed)


def deterministic_random_target(shape: str, layers: int | None = None):
    """(config, random-weight target, deterministic kernel settings from the environment) of a named shape,
    `layers` of its layers if given: what the deterministic-mode probes compile their forwards from."""
    import dataclasses

    from jeagle.config import ModelConfig
    from jeagle.kernels.settings import KernelSettings
    from jeagle.models.llama import random_model

    cfg = ModelConfig(**SHAPES[shape])
    if layers:
        cfg = dataclasses.replace(cfg, num_layers=layers)
    return cfg, random_model(cfg), dataclasses.replace(KernelSettings.from_env(), deterministic=True)


def random_target_and_head(shape: str):
    """A random-weight target of a named shape and a random one-layer EAGLE-1 head for it: what the
    speculative benches time (a round's cost depends on shapes, not weights)."""
    from jeagle.config import DraftConfig, ModelConfig
    from jeagle.models.eagle import random_draft
    from jeagle.models.llama import random_model

    cfg = ModelConfig(**SHAPES[shape])
    head = random_draft(DraftConfig(kind="eagle1", hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                                    num_layers=1, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                                    head_dim=cfg.head_dim, vocab_size=cfg.vocab_size, fc_bias=True), seed=1)
    return random_model(cfg), head


def phased_models(shape: str, mid_noise: float, seed: int = 0):
    """(target, {phase: head params}, head graph) with acceptance made, not found (bench/adaptive.py's
    workload, also bench/serve.py's): the target has `shape`'s sizes (so every step costs what that
    model's does) with its attention and MLP outputs zeroed and its lm_head a row permutation of its
    embedding, which makes its next token a fixed permutation of the current one; a one-layer EAGLE-1
    head whose fc maps the token embedding through (identity + noise) proposes that function with a
    chosen error rate. Phases (same graph, new values):

        high   the noiseless head: the target's own next token at every depth (accepts everything)
        mid    fc noise `mid_noise`: partial acceptance
        low    the sign-flipped head: never the target's token (accepts nothing)
    """
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jeagle.config import DraftConfig, ModelConfig
    from jeagle.models.eagle import random_draft
    from jeagle.models.llama import random_model

    # Untied: lm_head = the embedding rows permuted, so the next token is perm⁻¹(token) (a tied head
    # would make every token its own successor). The step reads the same bytes as a tied head.
    cfg = ModelConfig(**{**SHAPES[shape], "tie_word_embeddings": False})
    target = random_model(cfg, seed)
    e = np.asarray(target.embed[...], np.float32)
    e /= np.sqrt((e * e).mean(-1, keepdims=True))
    target.embed[...] = jnp.asarray(e, target.embed[...].dtype)
    target.lm_head[...] = jnp.asarray(e[np.random.default_rng(seed).permutation(len(e))], target.lm_head[...].dtype)
    target.wo[...] = jnp.zeros_like(target.wo[...])
    target.w_down[...] = jnp.zeros_like(target.w_down[...])

    dcfg = DraftConfig(kind="eagle1", hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                       num_layers=1, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                       vocab_size=cfg.vocab_size, fc_bias=False, dtype=cfg.dtype)
    h = cfg.hidden_size
    params = {}
    graph = None
    for phase, (sign, noise) in {"high": (1.0, 0.0), "mid": (1.0, mid_noise), "low": (-1.0, 0.0)}.items():
        head = random_draft(dcfg, seed + 1)
        fc = np.zeros((2 * h, h), np.float32)
        fc[:h] = sign * np.eye(h)
        fc += noise * np.random.default_rng(seed + 2).standard_normal(fc.shape).astype(np.float32)
        head.fc_w[...] = jnp.asarray(fc, head.fc_w[...].dtype)
        head.wo[...] = jnp.zeros_like(head.wo[...])
        head.w_down[...] = jnp.zeros_like(head.w_down[...])
        graph, params[phase] = nnx.split(head)
    return target, params, nnx.merge(graph, params["high"])


def plain_hf_model(gguf: Path, dtype: str = "bfloat16"):
    """SmolLM2 from its GGUF as a plain (unquantized) transformers model: dequantised on load, then the
    same weights in a model without the GGUF quantization config (which blocks save_pretrained, needed by
    eagle_llm_peer.py; both peers then run the very same model object type and weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype))
    config = loaded.config
    config.__dict__.pop("quantization_config", None)
    plain = type(loaded)(config).to(getattr(torch, dtype))
    plain.load_state_dict(loaded.state_dict())
    return plain


# ---- profiler traces ------------------------------------------------------------------------------------
def trace_events(trace_dir: str) -> list[dict]:
    """Every event of the latest trace json under `trace_dir` (a `jax.profiler.trace` folder)."""
    files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    files += glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not files:
        raise RuntimeError(f"no trace json under {trace_dir}")
    with gzip.open(sorted(files)[-1]) as f:
        doc = json.load(f)
    return doc["traceEvents"] if isinstance(doc, dict) else doc


def device_events_by_device(trace_dir: str, with_module: bool = False,
                            with_args: bool = False) -> dict[str, list[tuple]]:
    """{device process name: [(name, duration_us), ...]} of the ops the trace puts on GPU streams;
    with_module: [(name, duration_us, start_us, hlo module or "")] (the module: which executable ran it);
    with_args: the same with the event's args (dict) last (`PhaseMap` reads them)."""
    events = trace_events(trace_dir)
    gpu_pids = {e["pid"]: str(e["args"]["name"]) for e in events if e.get("ph") == "M"
                and e.get("name") == "process_name" and "gpu" in str(e.get("args", {}).get("name", "")).lower()}
    out: dict[str, list[tuple]] = {name: [] for name in gpu_pids.values()}
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in gpu_pids:
            dur, args = float(e.get("dur", 0)), e.get("args") or {}
            row = (e["name"], dur)
            if with_module or with_args:
                row += (float(e.get("ts", 0)), str(args.get("hlo_module", "")))
            out[gpu_pids[e["pid"]]].append(row + (args,) if with_args else row)
    return out


def idle_gaps(events: list[tuple], top: int = 5) -> tuple[float, list[float]]:
    """(total idle us, the `top` largest gaps in us) between the first and last device op of `events`:
    time the device waited (on the host, or on a host->device copy), overlapping ops merged."""
    spans = sorted((e[2], e[2] + e[1]) for e in events)
    gaps, end = [], None
    for s, t in spans:
        if end is not None and s > end:
            gaps.append(s - end)
        end = t if end is None else max(end, t)
    return sum(gaps), sorted(gaps, reverse=True)[:top]


# ---- device time by phase: named scopes through the optimized HLO -----------------------------------------
# A GPU kernel's trace event carries as args the key=value pairs of the XLA annotations on the launching
# thread (openxla/xla: xla/backends/gpu/runtime/annotation.cc writes "XlaModule:#hlo_module=M,program_id=..#"
# per executable and "Thunk:#name=N,hlo_op=I,unique_hlo_op_id=..#" per thunk; xla/backends/profiler/gpu/
# cupti_collector.cc turns them into stats, innermost first; xla/tsl/profiler/convert/xplane_to_trace_events.cc
# writes every stat but internal ones, program_id included, as an arg): `hlo_op` (the HLO instruction),
# `hlo_module` (the executable's module), `name` (the instruction's op_name less the module's common prefix),
# `unique_hlo_op_id` (detailed annotations add `op_name`, `op_type`, `shape`), and the collector's own
# (`correlation_id`, `context_id`, occupancy, `tf_op`). While profiling, command buffers run thunk by thunk
# (command_buffer_thunk.cc), so kernels inside them are annotated too. XLA CPU's thunk events (host
# threads) carry `hlo_op` and `hlo_module` as well. An instruction's op_name (its metadata in the optimized
# HLO) holds the named-scope path: jit(round_step)/.../verify_forward/dot_general.
_HLO_INSTR = re.compile(r"^\s+(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_HLO_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*[({]")
_HLO_OP_NAME = re.compile(r'\bop_name="((?:[^"\\]|\\.)*)"')
_HLO_CALLS = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation|branch_computations"
                        r"|called_computations)=(\{[^}]*\}|%?[\w.\-]+)")


def scope_of(op_name: str, scopes) -> str | None:
    """The first (outermost) of `scopes` that is a component of the op_name path, else None."""
    return next((part for part in op_name.split("/") if part in scopes), None)


def parse_hlo(text: str):
    """(module name, entry computation, {computation: [instruction]}, {instruction: (op_name, [called
    computation], [operand])}) of an HLO module's text (`compiled.as_text()`: one instruction a line)."""
    module, entry, comps, instrs, comp = "", None, {}, {}, None
    for line in text.splitlines():
        if line.startswith("HloModule "):
            module = line.split()[1].rstrip(",")
        elif not line[:1].isspace() and line.rstrip().endswith("{") and (m := _HLO_COMP.match(line)):
            comp = m.group(1)
            comps[comp] = []
            if line.startswith("ENTRY"):
                entry = comp
        elif line.startswith("}"):
            comp = None
        elif comp is not None and (m := _HLO_INSTR.match(line)):
            rest = m.group(2)
            op = _HLO_OP_NAME.search(rest)
            calls = [c for g in _HLO_CALLS.findall(rest) for c in re.findall(r"%?([\w.\-]+)", g)]
            comps[comp].append(m.group(1))
            instrs[m.group(1)] = (op.group(1) if op else "", calls, re.findall(r"%([\w.\-]+)", rest))
    return module, entry, comps, instrs


def hlo_phases(text: str, scopes) -> tuple[str, dict[str, str]]:
    """(module name, {instruction: phase}) of an optimized HLO module. An instruction's phase is the first of
    `scopes` in its own op_name; else the one most instructions of the computations it calls have (a fusion
    whose root carries no scope, a call, a while); else its caller's (the body of a while, a fused computation;
    passed down where the caller's phase is its own or all its callees'); else, for an instruction without
    metadata (made by an XLA pass), the one most of its users, else of its operands, have; else "other"."""
    module, entry, comps, instrs = parse_hlo(text)
    own = {i: scope_of(op, scopes) for i, (op, *_) in instrs.items()}
    votes: dict[str, Counter] = {}

    def comp_votes(c: str) -> Counter:  # explicit scopes inside computation c, nested calls included
        if c not in votes:
            votes[c] = Counter()  # (HLO calls have no cycles: a guard only)
            v = Counter(own[i] for i in comps.get(c, ()) if own[i])
            for i in comps.get(c, ()):
                for called in instrs[i][1]:
                    v.update(comp_votes(called))
            votes[c] = v
        return votes[c]

    phases: dict[str, str | None] = {}
    todo, seen = [(entry, None)] + [(c, None) for c in comps if c != entry], set()
    while todo:
        c, inherited = todo.pop(0)
        if c is None or c in seen or c not in comps:
            continue
        seen.add(c)
        down = {}
        for i in comps[c]:
            v = Counter()
            for called in instrs[i][1]:
                v.update(comp_votes(called))
            phases[i] = own[i] or (v.most_common(1)[0][0] if v else None) or inherited
            down[i] = phases[i] if own[i] or len(v) < 2 else None  # a mixed caller passes nothing down
        names = set(comps[c])
        users = defaultdict(list)
        for i in comps[c]:
            for o in instrs[i][2]:
                if o in names:
                    users[o].append(i)
        for _ in range(len(comps[c])):  # no metadata: the neighbours' phase, until nothing changes
            changed = False
            for i in comps[c]:
                if phases[i] is None and not instrs[i][0]:
                    near = ([phases[u] for u in users[i] if phases[u] not in (None, "other")]
                            or [phases[o] for o in instrs[i][2] if o in names and phases[o] not in (None, "other")])
                    if near:
                        phases[i] = down[i] = Counter(near).most_common(1)[0][0]
                        changed = True
            if not changed:
                break
        for i in comps[c]:
            phases[i] = phases[i] or "other"
            todo[:0] = [(called, down[i]) for called in instrs[i][1]]
    return module, phases


def kernel_name(instruction: str) -> str:
    """The name XLA gives the GPU kernel of an instruction (llvm_ir::SanitizeFunctionName: "loop_add_fusion.3"
    runs as "loop_add_fusion_3")."""
    return re.sub(r"[^A-Za-z0-9_$]", "_", instruction)


class PhaseMap:
    """A trace event -> its phase, from the optimized HLO of the executables that ran (`hlo_phases`).

    An event is looked up by its `hlo_op` arg in its `hlo_module`'s instructions (executables sharing a
    module name, e.g. one per prefix bucket, vote); else by the scope in its `name` / `long_name` / `tf_op`
    arg; else by its own name as a kernel name of an instruction; else it is "unattributed"."""

    def __init__(self, hlo_texts, scopes):
        self.scopes = tuple(scopes)
        self.ops: dict[str, dict[str, Counter]] = defaultdict(lambda: defaultdict(Counter))
        self.kernels: dict[str, dict[str, Counter]] = defaultdict(lambda: defaultdict(Counter))
        for text in hlo_texts:
            module, phases = hlo_phases(text, self.scopes)
            for instr, phase in phases.items():
                self.ops[module][instr][phase] += 1
                self.kernels[module][kernel_name(instr)][phase] += 1

    @staticmethod
    def _lookup(table, module: str, key: str) -> str | None:
        votes = Counter()
        for m in ([module] if module else list(table)):
            votes.update(table.get(m, {}).get(key, {}))
        return votes.most_common(1)[0][0] if votes else None

    def __call__(self, name: str, args: dict | None = None) -> str:
        args = args or {}
        module = str(args.get("hlo_module", ""))
        # (One instruction; should a trace join nested ones, a while's and its body's, the scoped one wins.)
        found = [self._lookup(self.ops, module, op) for op in re.split(r"[\s,;]+", str(args.get("hlo_op", ""))) if op]
        if any(found):
            return next((ph for ph in found if ph not in (None, "other")), "other")
        for key in ("name", "long_name", "tf_op", "op_name"):
            if phase := scope_of(str(args.get(key, "")), self.scopes):
                return phase
        return self._lookup(self.kernels, module, kernel_name(name)) or "unattributed"

    def busy_us(self, events) -> dict[str, tuple[int, float]]:
        """{phase: (ops, busy us)} of `events` ((name, duration_us, start_us, module, args), as
        `device_events_by_device(..., with_args=True)` gives them), in `scopes` order, then "other" and
        "unattributed"."""
        out: dict[str, list] = {p: [0, 0.0] for p in (*self.scopes, "other", "unattributed")}
        for name, dur, *_, args in events:
            row = out[self(name, args)]
            row[0] += 1
            row[1] += dur
        return {p: (c, t) for p, (c, t) in out.items() if c}
