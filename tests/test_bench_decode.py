"""bench/decode.py's bookkeeping on synthetic stats (no engine): a run over several waves counts each
wave's round dispatches per tier from that wave's own tier history, and the plot draws one line per
system and bucket rule."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def decode_module():
    if str(BENCH) not in sys.path:  # the script imports its helpers as `common`, as when run from bench/
        sys.path.insert(0, str(BENCH))
    return importlib.import_module("decode")


def wave(history: dict, dispatches: int, rounds: int, accept: float) -> dict:
    zeros = {k: 0 for k in ("steps", "wall_s", "new_tokens", "prompt_tokens", "grammar_mask_ms",
                            "grammar_rows_walked", "grammar_rows_masked", "prefill_calls", "admission_held_steps")}
    return zeros | {"tier_history": history, "round_dispatches": dispatches, "rounds": rounds,
                    "accept_length": accept, "tokens": [[1, 2]]}


def test_waves_count_each_waves_tier_history():
    """Wave 1 ran 10 dispatches on A then 20 on B; wave 2 5 on B then 15 on A. The last wave's history
    over the summed dispatches would give B 5 and A 45."""
    decode = decode_module()
    merged = decode.merge_waves([wave({"0": [3, 4, 5], "10": [7, 4, 11]}, 30, 30, 2.0),
                                 wave({"0": [7, 4, 11], "5": [3, 4, 5]}, 20, 20, 3.0)])
    assert merged["dispatches_per_tier"] == {"3,4,5": 25, "7,4,11": 25}
    assert merged["round_dispatches"] == 50 and abs(merged["accept_length"] - 2.4) < 1e-9
    static = decode.merge_waves([wave(None, 7, 7, 1.0), wave(None, 9, 9, 1.0)])  # target-only: no history
    assert static["dispatches_per_tier"] == {}


def test_plot_draws_a_line_per_system_and_bucket_rule():
    decode = decode_module()
    rows = [{"system": s, "batch": b, "tokens_per_s": float(b * r), "bucket_shrink_ratio": r}
            for s in ("jeagle", "jeagle-eagle") for r in (1.0, 2.0) for b in (16, 1)]
    series = decode.plot_series(rows)
    assert sorted(series) == ["jeagle, bucket_shrink_ratio 1.0", "jeagle, bucket_shrink_ratio 2.0",
                              "jeagle-eagle, bucket_shrink_ratio 1.0", "jeagle-eagle, bucket_shrink_ratio 2.0"]
    assert series["jeagle, bucket_shrink_ratio 2.0"] == [(1, 2.0), (16, 32.0)]
    one_rule = decode.plot_series([r for r in rows if r["bucket_shrink_ratio"] == 2.0])
    assert sorted(one_rule) == ["jeagle", "jeagle-eagle"]
    hf = [{"system": "hf", "batch": 1, "tokens_per_s": 3.0}]  # the transformers peer's rows: no bucket rule
    ratio2 = [r for r in rows if r["bucket_shrink_ratio"] == 2.0]
    assert sorted(decode.plot_series(ratio2 + hf)) == ["hf", "jeagle", "jeagle-eagle"]
    assert "hf" in decode.plot_series(rows + hf)
