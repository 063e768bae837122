"""`kvstore simulate` through click: the fixed JSON contract, tiers, and errors a user sees."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from kvstore.cli.simulate import simulate
from kvstore.policy.trace import read_trace

SLICE = Path(__file__).parent / "data" / "mooncake_slice.jsonl"


def write_trace(path: Path, requests: list[list[int]]) -> Path:
    path.write_text(
        "".join(
            json.dumps({"timestamp": i, "input_length": 512 * len(r), "output_length": 1, "hash_ids": r})
            + "\n"
            for i, r in enumerate(requests)
        )
    )
    return path


def test_json_contract_on_a_hand_made_trace(tmp_path: Path) -> None:
    # 4 distinct blocks; capacity 0.5 → 2 blocks
    trace = write_trace(tmp_path / "t.jsonl", [[1, 2], [1, 2], [1, 3], [1, 2, 4]])
    res = CliRunner().invoke(
        simulate, ["--trace", str(trace), "--capacity-fraction", "0.5", "--policy", "lru", "--json"]
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert {k: out[k] for k in ("policy", "capacity_blocks", "requests", "block_refs")} == {
        "policy": "lru",
        "capacity_blocks": 2,
        "requests": 4,
        "block_refs": 9,
    }
    # [1,2] miss; [1,2] 2 hits; [1,3] 1 hit (3 evicts 2); [1,2,4] 1 hit
    assert out["prefix_hits"] == 4
    assert out["hit_ratio"] == 4 / 9


def test_every_policy_runs_on_the_trace_slice_and_belady_bounds_them() -> None:
    ratios = {}
    for policy in ("lru", "lfu", "arc", "wtinylfu", "chain", "reuse", "belady"):
        res = CliRunner().invoke(
            simulate, ["--trace", str(SLICE), "--capacity-fraction", "0.1", "--policy", policy, "--json"]
        )
        assert res.exit_code == 0, res.output
        ratios[policy] = json.loads(res.output)["hit_ratio"]
    assert all(0 < r <= ratios["belady"] for r in ratios.values())


def test_multi_tier_report_and_held_out_slices() -> None:
    res = CliRunner().invoke(
        simulate,
        [
            "--trace",
            str(SLICE),
            "--tiers",
            "hot:2%:20GB,disk:10%:2GB:lru",
            "--skip",
            "100",
            "--limit",
            "200",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["requests"] == 200
    hot, disk = out["tiers"]
    assert (hot["policy"], disk["policy"]) == ("chain", "lru")
    assert hot["hits"] + disk["hits"] == out["prefix_hits"]
    assert disk["demotions_in"] > 0 and out["load_seconds"] > 0
    text = CliRunner().invoke(simulate, ["--trace", str(SLICE), "--tiers", "hot:2%,disk:10%"])
    assert "hit ratio" in text.output and "disk" in text.output


def test_errors_say_what_to_do(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    res = CliRunner().invoke(simulate, ["--trace", str(bad)])
    assert res.exit_code != 0 and "hash_ids" in str(res.exception)
    res = CliRunner().invoke(simulate, ["--trace", str(SLICE), "--tiers", "hot"])
    assert res.exit_code == 2 and "NAME:CAPACITY" in res.output
    res = CliRunner().invoke(simulate, ["--trace", str(SLICE), "--policy", "fifo"])
    assert res.exit_code == 2
    res = CliRunner().invoke(simulate, ["--trace", str(SLICE), "--tiers", "a:1%,b:1%", "--policy", "belady"])
    assert res.exit_code == 2 and "belady" in res.output


def test_trace_reader_keeps_order_and_limit() -> None:
    reqs = read_trace(SLICE, limit=3)
    assert len(reqs) == 3 and reqs[0].timestamp <= reqs[1].timestamp
    assert all(isinstance(b, int) for b in reqs[0].hash_ids)
