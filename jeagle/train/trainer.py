"""The training loop: optax AdamW (warm-up, cosine decay, clipping), fp32 master weights with bf16
compute, orbax checkpoints with resume, a progress bar with the loss and per-step top-1 agreement,
and an evaluation that runs the real engine to measure accept length."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jeagle.config import DraftConfig, ModelConfig, default_aux_layer_ids
from jeagle.train.data import DraftData, batches, length_buckets
from jeagle.train.model import draft_loss, init_params, target_outputs


@dataclass
class TrainConfig:
    kind: str = "eagle3"
    num_layers: int = 1
    draft_vocab_size: int = 8192  # EAGLE-3
    ttt_steps: int = 7  # training-time-test steps (EAGLE-1 default: 1)
    step_decay: float = 0.8
    ce_weight: float = 0.1  # EAGLE-1: weight of the cross-entropy next to the feature regression
    steps: int = 2000
    batch_size: int = 16
    seq_len: int = 640
    # Row lengths per batch (data.length_buckets): 8 groups samples by length into rows of seq_len/8 .. seq_len,
    # each batch batch_size x seq_len positions; 1 pads every row to seq_len. On the regenerated SmolLM2 mix
    # (H200, 32 x 1,024, 7 TTT steps): 40,599 loss tokens/s at 1, 104,546 at 4, 134,651 at 8 (bench/RESULTS.md).
    length_buckets: int = 8
    lr: float = 5e-4
    warmup_steps: int = 100
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.0
    clip_norm: float = 0.5
    b2: float = 0.95
    compute_dtype: str = "bfloat16"
    seed: int = 0
    log_every: int = 10
    save_every: int = 500
    extra: dict = field(default_factory=dict)


def draft_config_for(target: ModelConfig, tc: TrainConfig, *, name: str = "") -> DraftConfig:
    """A head shaped like one layer of the target (its width, heads and MLP). EAGLE-3 features: EAGLE-3's
    default layers (2, L/2, L-3), clamped into the target for very shallow (test) targets."""
    aux = tuple(sorted(min(max(i, 0), target.num_layers - 1) for i in default_aux_layer_ids(target.num_layers)))
    return DraftConfig(kind=tc.kind, hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
                       num_layers=tc.num_layers, num_heads=target.num_heads, num_kv_heads=target.num_kv_heads,
                       head_dim=target.head_dim, vocab_size=target.vocab_size, rms_norm_eps=target.rms_norm_eps,
                       rope_theta=target.rope_theta,
                       fc_bias=tc.kind == "eagle1", draft_vocab_size=tc.draft_vocab_size if tc.kind == "eagle3" else 0,
                       target_hidden_size=target.hidden_size if tc.kind == "eagle3" else 0,
                       aux_layer_ids=aux if tc.kind == "eagle3" else (),
                       dtype=tc.compute_dtype, name=name)


def make_optimizer(tc: TrainConfig):
    schedule = optax.warmup_cosine_decay_schedule(0.0, tc.lr, max(1, tc.warmup_steps), max(tc.steps, tc.warmup_steps + 1),
                                                  end_value=tc.lr * tc.min_lr_ratio)
    return optax.chain(optax.clip_by_global_norm(tc.clip_norm),
                       optax.adamw(schedule, b1=0.9, b2=tc.b2, weight_decay=tc.weight_decay)), schedule


class Trainer:
    """Holds the target (frozen), the head's fp32 parameters and optimizer state, and one jitted step."""

    def __init__(self, target, cfg: DraftConfig, tc: TrainConfig, *, used_ids=None, params=None, d2t=None):
        self.target_graphdef, target_state = nnx.split(target)
        self.target_params = nnx.to_pure_dict(target_state)
        self.target_state = target_state
        self.cfg, self.tc = cfg, tc
        self.used_ids = None if used_ids is None else jnp.asarray(used_ids, jnp.int32)
        if params is None:
            params, d2t = init_params(cfg, self.target_params, seed=tc.seed, used_ids=used_ids)
        self.optimizer, self.schedule = make_optimizer(tc)
        # Both are donated to each step: give every leaf its own buffer (optax may share constants).
        self.params, self.d2t = _own_buffers(params), d2t
        self.opt_state = _own_buffers(self.optimizer.init(self.params))
        self.step = 0
        self.tokens_seen = 0  # loss tokens trained on, over every run of this schedule (resumes included)
        # What the run trains on (DraftData.fingerprint), kept with each checkpoint: a resume over other
        # data (regenerated on another machine) would change the order and the held-out split.
        self.data_fingerprint = ""
        self._train_step = jax.jit(self._step_fn, donate_argnums=(0, 1))

    def _step_fn(self, params, opt_state, target_state, batch):
        tc, cfg = self.tc, self.cfg
        target = nnx.merge(self.target_graphdef, target_state)
        tparams = nnx.to_pure_dict(target_state)
        aux = cfg.aux_layer_ids if cfg.kind == "eagle3" else ()
        tout = jax.lax.stop_gradient(target_outputs(target, batch["tokens"], batch["lengths"], aux_layers=aux))
        dt = jnp.dtype(tc.compute_dtype)

        def loss_fn(p):
            pc = jax.tree.map(lambda x: x.astype(dt), p)
            return draft_loss(pc, cfg, tparams, tout, batch, steps=tc.ttt_steps, decay=tc.step_decay,
                              used_ids=self.used_ids, ce_weight=tc.ce_weight)

        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        metrics["grad_norm"] = _tree_norm(grads)
        updates, opt_state = self.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, metrics

    def memory_analysis(self, batch: dict):
        """XLA's memory analysis of the training step compiled for `batch`'s shapes (nothing runs): on a
        CPU an estimate of whether a batch shape fits a GPU."""
        return self._train_step.lower(self.params, self.opt_state, self.target_state, batch).compile().memory_analysis()

    def train_step(self, batch: dict) -> dict:
        batch = {k: jnp.asarray(v) for k, v in batch.items()}
        self.params, self.opt_state, metrics = self._train_step(self.params, self.opt_state, self.target_state, batch)
        self.step += 1
        return metrics

    # -- checkpoints ------------------------------------------------------------------------------
    def manager(self, directory):
        import orbax.checkpoint as ocp

        return ocp.CheckpointManager(Path(directory).absolute(),
                                     options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))

    def save(self, mngr) -> None:
        import orbax.checkpoint as ocp

        if self.step == mngr.latest_step():
            return
        state = {"params": self.params, "opt_state": self.opt_state}
        if not mngr.save(self.step, args=ocp.args.StandardSave(state)):
            raise RuntimeError(f"orbax did not save step {self.step} (newest on disk: {mngr.latest_step()})")
        mngr.wait_until_finished()
        _write_progress(Path(mngr.directory), self.step, self.tokens_seen, self.data_fingerprint, self.schedule_settings(),
                        batching=self.batching_settings())

    def restore(self, mngr) -> bool:
        """Resume from the latest checkpoint in `mngr`; False when there is none."""
        import orbax.checkpoint as ocp

        latest = mngr.latest_step()
        if latest is None:
            return False
        abstract = {"params": self.params, "opt_state": self.opt_state}
        state = mngr.restore(latest, args=ocp.args.StandardRestore(abstract))
        self.params, self.opt_state = _own_buffers(state["params"]), _own_buffers(state["opt_state"])
        progress = _read_progress(Path(mngr.directory))
        self._check_data(progress, mngr.directory)
        self.step = int(latest)
        # progress.json is written after each save: it names the newest step (else the count is unknown).
        if progress.get("step") == self.step:
            self.tokens_seen = int(progress["tokens_seen"])
        else:
            print(f"warning: {mngr.directory} does not record the tokens seen up to step {self.step}; counting from 0",
                  flush=True)
        self._check_settings(progress, mngr.directory)
        return True

    def schedule_settings(self) -> dict:
        tc = self.tc
        return {"steps": tc.steps, "lr": tc.lr, "warmup_steps": tc.warmup_steps, "min_lr_ratio": tc.min_lr_ratio}

    def batching_settings(self) -> dict:
        """What decides the order of the batches (`data.batches`): a resume under the same continues it."""
        tc = self.tc
        return {"batch_size": tc.batch_size, "seq_len": tc.seq_len, "length_buckets": tc.length_buckets, "seed": tc.seed}

    def _check_settings(self, state: dict, where) -> None:
        """A resume under another schedule is allowed (e.g. training on past the planned steps), but the
        learning rate jumps: say so. Likewise under other batching: the order of the samples changes."""
        if state.get("schedule") and state["schedule"] != self.schedule_settings():
            print(f"warning: {where} was trained under the schedule {state['schedule']}; this run's is "
                  f"{self.schedule_settings()}: the learning rate jumps to the new schedule's value at step {self.step}",
                  flush=True)
        if state and state.get("batching") != self.batching_settings():
            print(f"warning: {where} was trained with the batches of {state.get('batching') or 'an older jeagle'}; "
                  f"this run's are {self.batching_settings()}: from step {self.step} the samples come in another "
                  "order (some of this epoch's may repeat or be skipped)", flush=True)

    def _check_data(self, state: dict, where) -> None:
        if state.get("data") and self.data_fingerprint and state["data"] != self.data_fingerprint:
            raise ValueError(f"{where} was trained on another dataset ({state['data']}, this run's is "
                             f"{self.data_fingerprint}): resume with the dataset it was trained on (--data)")

    # -- portable checkpoints: what travels between machines ---------------------------------------
    def save_portable(self, directory, draft_cfg: DraftConfig, **metadata) -> Path:
        """The fp32 master weights as a jeagle draft dir (loadable with --draft, --init-from) plus
        trainer_state.json (step, tokens seen): a fraction of the orbax checkpoint's size (no optimizer
        moments), so it fits what a machine can send back. `load_portable` resumes from it."""
        from jeagle.loading.checkpoint import save_checkpoint
        from jeagle.train.model import export_params

        directory = Path(directory)
        tmp = directory.with_name(directory.name + ".tmp")
        cfg = draft_cfg.replace(dtype="float32")
        save_checkpoint(tmp, cfg, export_params(self.params, cfg, self.d2t), metadata={k: str(v) for k, v in metadata.items()})
        _write_progress(tmp, self.step, self.tokens_seen, self.data_fingerprint, self.schedule_settings(),
                        batching=self.batching_settings(), name="trainer_state.json")
        if directory.exists():
            import shutil

            shutil.rmtree(directory)
        tmp.replace(directory)
        return directory

    def load_portable(self, directory) -> None:
        """Resume from `save_portable`'s dir: the fp32 weights exactly, the step and tokens seen; the
        optimizer's moments start afresh at that step of the schedule (AdamW's moments here have a memory
        of ~10 (b1 0.9) and ~20 (b2 0.95) steps, so little is lost), their count set to the step so the
        learning-rate schedule continues where it stopped."""
        from jeagle.loading.checkpoint import load_draft

        directory = Path(directory)
        state = _read_progress(directory, "trainer_state.json")
        self._check_data(state, directory)
        head = load_draft(directory, dtype="float32")
        pure = nnx.to_pure_dict(nnx.split(head)[1])
        d2t = pure.pop("d2t", None)
        if d2t is not None and self.d2t is not None and not np.array_equal(np.asarray(d2t), self.d2t):
            raise ValueError(f"{directory}: its draft vocabulary differs from this run's")
        differing = set(self.params) ^ set(k for k, v in pure.items() if v is not None)
        if differing:
            raise ValueError(f"{directory}: not this head's parameters (differing: {sorted(differing)[:4]})")
        self.params = _own_buffers({k: jnp.asarray(pure[k], jnp.float32) for k in self.params})
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
        self._check_settings(state, directory)
        fresh = self.optimizer.init(self.params)
        self.opt_state = _own_buffers(optax.tree_utils.tree_set(fresh, count=jnp.asarray(self.step, jnp.int32)))


def _write_progress(directory: Path, step: int, tokens_seen: int, data: str, schedule: dict, *, batching: dict,
                    name: str = "progress.json") -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_text(json.dumps({"step": int(step), "tokens_seen": int(tokens_seen), "data": data,
                                              "schedule": schedule, "batching": batching}))


def _read_progress(directory: Path, name: str = "progress.json") -> dict:
    """A checkpoint's step, tokens seen and dataset fingerprint ({} where none was written)."""
    try:
        return json.loads((Path(directory) / name).read_text())
    except (OSError, ValueError):
        return {}


def checkpoint_steps(ckpt_dir, portable_dir) -> tuple[int | None, int | None]:
    """The newest step of the orbax checkpoints in `ckpt_dir` and of the portable checkpoint (None: none)."""
    ckpt_dir = Path(ckpt_dir)
    steps = [int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit()] if ckpt_dir.is_dir() else []
    portable = _read_progress(Path(portable_dir), "trainer_state.json").get("step")
    return (max(steps) if steps else None), (None if portable is None else int(portable))


def _tree_norm(tree):
    """Global L2 norm (optax.tree.norm where this optax has it, else its older global_norm)."""
    norm = getattr(getattr(optax, "tree", None), "norm", None)
    return norm(tree) if norm is not None else optax.global_norm(tree)


def _own_buffers(tree):
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def fmt_metrics(m: dict, steps: int) -> dict:
    acc = "/".join(f"{float(m[f'acc{s}']):.2f}" for s in range(steps))
    return {"loss": f"{float(m['loss']):.3f}", "acc": acc}


def train(trainer: Trainer, data: DraftData, *, ckpt_dir=None, resume: bool = False, progress: bool = True,
          log=None, time_limit: float | None = None, on_save=None, on_eval=None, eval_every: int = 0,
          eval_at_start: bool = False) -> list[dict]:
    """Run trainer.tc.steps steps over `data` (resuming from ckpt_dir if asked and it holds a step past
    trainer.step); returns the logged metrics (one dict per log interval, means over the interval).
    `on_save(trainer)` runs with every checkpoint (a portable copy), once a step at most; `on_eval(trainer)`
    before the first step of a fresh schedule (`eval_at_start`), after every `eval_every` steps and when
    the run stops. With `time_limit` (seconds of wall time; the evaluations inside the loop count, the
    one at the stop runs after it) the run stops once it is spent, after saving: a later --resume run
    finishes the schedule."""
    from tqdm import tqdm

    tc = trainer.tc
    mngr = trainer.manager(ckpt_dir) if ckpt_dir else None
    latest = None if mngr is None else mngr.latest_step()
    if latest is not None and not resume:
        # Orbax keeps the newest step: a fresh run's saves below it would be dropped without a word.
        raise ValueError(f"{ckpt_dir} already holds a checkpoint at step {latest}: pass --resume to continue it, or "
                         "use another --out")
    if latest is not None and latest > trainer.step and trainer.restore(mngr):
        print(f"resumed from step {trainer.step}", flush=True)
    history: list[dict] = []
    it = batches(data, tc.batch_size, tc.seq_len, seed=tc.seed, start_step=trainer.step,
                 buckets=length_buckets(tc.seq_len, tc.length_buckets))
    bar = tqdm(total=tc.steps, initial=trainer.step, desc="train", unit="step", disable=not progress, dynamic_ncols=True)
    window: list[dict] = []
    t0 = time.perf_counter()
    tokens = 0
    paused = 0.0  # time spent evaluating and saving, not training

    saved_step = None

    def over() -> bool:
        return time_limit is not None and time.perf_counter() - t0 > time_limit

    def save() -> None:
        nonlocal paused, saved_step
        if saved_step == trainer.step:
            return
        t1 = time.perf_counter()
        if mngr is not None:
            trainer.save(mngr)
        if on_save is not None:
            on_save(trainer)
        saved_step = trainer.step
        paused += time.perf_counter() - t1

    def evaluate() -> None:
        nonlocal paused
        t1 = time.perf_counter()
        on_eval(trainer)
        paused += time.perf_counter() - t1

    if on_eval is not None and eval_at_start and trainer.step == 0:  # not after a restore
        evaluate()
    while trainer.step < tc.steps:
        batch = next(it)
        n = int(batch["loss_mask"].sum())
        tokens += n
        trainer.tokens_seen += n
        window.append(trainer.train_step(batch))
        bar.update(1)
        last = trainer.step == tc.steps or over()
        if trainer.step % tc.log_every == 0 or last:
            mean = {k: float(np.mean([float(w[k]) for w in window])) for k in window[0]}
            mean.update(step=trainer.step, lr=float(trainer.schedule(trainer.step)), tokens_seen=trainer.tokens_seen,
                        tokens_per_s=tokens / max(time.perf_counter() - t0 - paused, 1e-9))
            history.append(mean)
            bar.set_postfix(fmt_metrics(mean, tc.ttt_steps))
            if log is not None:
                log.write(json.dumps(mean) + "\n")
                log.flush()
            window = []
        if trainer.step % tc.save_every == 0 or last:
            save()
            last = last or over()  # the save itself may have spent the time
        if on_eval is not None and ((eval_every and trainer.step % eval_every == 0) or last):
            evaluate()
            last = last or over()  # so may the evaluation
        if last:
            save()  # a no-op where this step is saved already
            break
    if trainer.step < tc.steps:
        print(f"time limit reached at step {trainer.step} of {tc.steps}; checkpoint saved (--resume continues)",
              flush=True)
    bar.close()
    if mngr is not None:
        mngr.close()
    return history


def evaluate_accept_length(model, head, prompt_ids: list[list[int]], *, spec=(5, 4, 8), max_new_tokens: int = 128,
                           batch_size: int = 16) -> dict:
    """Greedy generation with the real engine (speculative) and this head: average accept length (tokens
    per round, bonus included) and tokens/s. The engine's speed on CPU means little; its acceptance does."""
    from jeagle.engine import EngineConfig, SpecConfig, speculative
    from jeagle.sampling import SamplingParams

    s, k, n = spec
    ctx = max(len(p) for p in prompt_ids) + max_new_tokens + 2 * max(s * k, n) + 16  # + the over-allocation
    engine = speculative(model, head, EngineConfig(max_batch_size=min(batch_size, len(prompt_ids)), max_context=ctx),
                        SpecConfig(num_steps=s, topk=k, num_draft_tokens=n))
    outs = engine.generate(prompt_ids, SamplingParams(max_new_tokens=max_new_tokens))
    stats = engine.last_stats
    return {"spec": list(spec), "accept_length": stats.accept_length, "prompts": len(prompt_ids),
            "tokens": sum(len(o.token_ids) for o in outs), "outputs": [o.token_ids for o in outs]}


def summary(tc: TrainConfig) -> dict:
    return asdict(tc)
