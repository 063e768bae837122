"""`benchmarks/policy_limits.py`: the information-limit analysis quoted in the policy benchmark doc."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "policy_limits.py"
SLICE = Path(__file__).parent / "data" / "mooncake_slice.jsonl"


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("policy_limits", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_auc_is_one_for_a_perfect_score_and_one_half_for_none() -> None:
    limits = load()
    labels = [False, False, True, True]
    assert limits.auc([0.1, 0.2, 0.8, 0.9], labels) == 1.0
    assert limits.auc([0.9, 0.8, 0.2, 0.1], labels) == 1.0  # folded: an inverted score informs as much
    assert limits.auc([0.5, 0.5, 0.5, 0.5], labels) == 0.5


def test_structure_finds_conversations_and_their_turns() -> None:
    limits = load()
    from kvstore.policy.trace import Request

    reqs = [
        Request(0, 1024, 1, (0, 1, 2)),  # turn 0
        Request(1, 1024, 1, (0, 3)),  # another conversation: shares only the head
        Request(2, 2048, 1, (0, 1, 4, 5)),  # continues the first
        Request(3, 2048, 1, (0, 1, 4, 6, 7)),  # and again
    ]
    s = limits.structure(reqs)
    assert s.parent == [None, None, 0, 2]
    assert s.turn == [0, 0, 1, 2]
    assert s.continued == [True, False, True, False]
    assert s.prefix_hits == [0, 1, 2, 3]


def parse(output: str) -> dict[str, list[float]]:
    rows = {}
    for line in output.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 5 and cells[2].startswith("0."):
            rows[cells[0]] = [float(c) for c in cells[2:]]
    return rows


def test_script_runs_on_a_trace_slice_and_orders_the_information_levels() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--trace", str(SLICE), "--jobs", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    rows = parse(out)
    oracle = rows["oracle: which requests continue"]
    blind = rows["no features"]
    belady = rows["belady (the future)"]
    for f in range(3):
        # knowing which conversations continue is worth more than any statistics, and
        # nothing online beats the future
        assert oracle[f] > blind[f]
        assert oracle[f] <= belady[f] + 1e-9
        assert rows["lru (online)"][f] <= belady[f] + 1e-9
