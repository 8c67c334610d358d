"""The shipped EAGLE-3 head for SmolLM2-135M-Instruct (jeagle/heads/): it loads, it accepts (a
regression guard for the weights and the feature wiring), it stays lossless, and it is the default."""

from __future__ import annotations

import json

import pytest

from jeagle.heads import default_head_dir

CHATS = ["What is the capital of France?", "Write a short poem about the sea."]


@pytest.fixture(scope="module")
def smollm2_fp32():
    from jeagle.loading.checkpoint import load_model
    from jeagle.loading.fetch import default_target_dir

    return load_model(default_target_dir(quiet=True), dtype="float32")


def _generate(model, head, prompts, n, spec=(3, 1, 4)):
    from jeagle.engine import EngineConfig, speculative, target_only
    from jeagle.sampling import SamplingParams
    from jeagle.speculative.round import SpecConfig

    cfg = EngineConfig(max_batch_size=len(prompts), max_context=512)
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    if head is None:
        eng = target_only(model, cfg)
    else:
        s, k, d = spec
        eng = speculative(model, head, cfg, SpecConfig(num_steps=s, topk=k, num_draft_tokens=d))
    outs = eng.generate(prompts, params)
    return [o.token_ids for o in outs], eng.last_stats


def test_shipped_head_accepts_and_is_lossless(smollm2_fp32):
    from jeagle.loading.checkpoint import load_draft
    from jeagle.loading.fetch import default_target_dir
    from jeagle.loading.tokenizer import Tokenizer

    head_dir = default_head_dir()
    assert (head_dir / "model.safetensors").stat().st_size <= 25 * 2**20
    card = (head_dir / "README.md").read_text()
    assert "python -m jeagle.train_draft" in card and "accept length" in card
    head = load_draft(head_dir, target=smollm2_fp32.cfg, dtype="float32")
    assert head.cfg.kind == "eagle3"
    tok = Tokenizer.from_dir(default_target_dir(quiet=True))
    ids = [tok.encode_chat([{"role": "user", "content": c}]) for c in CHATS]
    spec, stats = _generate(smollm2_fp32, head, ids, 32)
    plain, _ = _generate(smollm2_fp32, None, ids, 32)
    assert spec == plain  # greedy speculative == greedy target-only, token for token
    assert stats.accept_length > 1.5, stats.accept_length


def test_default_cli_runs_eagle_with_the_shipped_head(smollm2_dir):
    from tests.test_cli import run_cli

    doc = json.loads(run_cli("--json", "--max-new-tokens", "16", CHATS[0]).stdout)
    assert doc["stats"]["draft"] == str(default_head_dir()) and doc["stats"]["rounds"] > 0
    plain = json.loads(run_cli("--json", "--speculative-algorithm", "none", "--max-new-tokens", "16", CHATS[0]).stdout)
    assert plain["stats"]["draft"] is None and plain["stats"]["rounds"] == 0
    assert doc["outputs"][0]["token_ids"] == plain["outputs"][0]["token_ids"]
