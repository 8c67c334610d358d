"""Does the throughput policy's depth model misjudge a deeper tier? Static (5,4,8), (7,4,11) and
(3,4,5) engines (SmolLM2 + the shipped head, MT-bench first turns, greedy, EOS ignored) give their accept-length
histograms; the depth model fed (5,4,8)'s rounds gives its estimates of every tier's tokens per round.

    JAX_PLATFORMS=cpu python bench/probes/depth_model_check.py --batch 16 --max-new-tokens 128
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import numpy as np  # noqa: E402
from jeagle.speculative.adaptive import AdaptiveConfig  # noqa: E402
from jeagle.speculative.adaptive_throughput import ThroughputPolicy  # noqa: E402
from jeagle.loading.checkpoint import load_draft, load_model  # noqa: E402
from jeagle.engine import EngineConfig, speculative  # noqa: E402
from jeagle.loading.fetch import resolve_draft, resolve_target  # noqa: E402
from jeagle.heads import default_head_dir  # noqa: E402
from jeagle.sampling import SamplingParams  # noqa: E402
from jeagle.speculative.round import SpecConfig  # noqa: E402
from jeagle.loading.tokenizer import Tokenizer  # noqa: E402
from decode import chat_ids, read_prompts  # noqa: E402

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--prompts", default=str(Path(__file__).resolve().parents[2] / ".data" / "mtbench.jsonl"))
p.add_argument("--batch", type=int, default=16)
p.add_argument("--max-new-tokens", type=int, default=128)
args = p.parse_args()
B, NEW = args.batch, args.max_new_tokens
target_dir = resolve_target(None, quiet=True)
head_dir = resolve_draft(str(default_head_dir()), target_dir, quiet=True)
ids = chat_ids(Tokenizer.from_dir(target_dir), read_prompts(args.prompts, ""))[:B]
model = load_model(target_dir)
head = load_draft(head_dir, target=model.cfg)
ec = EngineConfig(max_batch_size=B, batch_buckets=(B,), max_context=max(map(len, ids)) + NEW + 32)
sp = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
hists = {}
for tier in [(5, 4, 8), (7, 4, 11), (3, 4, 5)]:
    eng = speculative(model, head, ec, SpecConfig(*tier))
    eng.generate(ids, sp)
    st = eng.last_stats.speculative
    hists[tier] = {int(k): v for k, v in st.accept_length_histogram.items()}
    print(tier, "accept", round(st.accept_length, 3), "hist", dict(sorted(hists[tier].items())), flush=True)
# the depth model fed (5,4,8)'s rounds: accepted drafts = accept length - 1
tiers = [(3, 4, 5), (5, 4, 8), (7, 4, 11)]
pol = ThroughputPolicy(AdaptiveConfig(policy="throughput", candidate_tiers=tiers, accept_window=10**9), tiers, 1)
acc = np.concatenate([np.full(v, k - 1) for k, v in hists[(5, 4, 8)].items()])
pol.observe(acc, pol.reach[1])
pol.record(acc, 1)
print("depth model from (5,4,8):", [round(x, 3) for x in pol.expected_tokens()], "p_d", [round(p, 3) for p in pol.accept_rates()])
