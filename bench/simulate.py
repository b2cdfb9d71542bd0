"""ModelForge's policy against the fifo and ollama baselines on the real traces, side by side in
one run, and the replay speed of a 100,000-request scenario.

    .venv/bin/python bench/simulate.py            # everything (about 2 minutes on 2 cores)
    .venv/bin/python bench/simulate.py --quick    # the two traces only, no speed run

Targets (issue 8), checked and printed: on the mixed single-GPU scenario (Azure), modelforge has
0 invariant violations and 0 out-of-memory moments, a production p99 wait at most 0.7x the
ollama baseline's (over every call, a call never served waiting forever, and over the calls
served), no more loads than it, and at least 0.95x its VRAM utilization over the scenario's
common span; a 100,000-request scenario replays in at most 30 s.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from modelforge.simulate import SimulationResult, comparison_rows, load_scenario, simulate
from modelforge.traces import AlibabaOptions, AzureOptions, convert_alibaba, convert_azure

TRACES = Path(__file__).resolve().parents[1] / "data" / "traces"
POLICIES = ("modelforge", "fifo", "ollama")


def table(title: str, results: list[SimulationResult]) -> None:
    print(f"\n## {title}\n")
    print("| metric | " + " | ".join(r.policy for r in results) + " |")
    print("|---|" + "---:|" * len(results))
    for label, cells in comparison_rows(results):
        print(f"| {label} | " + " | ".join(cells) + " |")


def seconds(value: object) -> str:
    return "never" if value is None else f"{value:.2f} s"


def ratio_of(mine: object, theirs: object) -> str:
    if not isinstance(mine, float):
        return "-"
    return "0 (theirs never)" if not isinstance(theirs, float) else f"{mine / theirs:.3f}" if theirs else "-"


def check(label: str, ok: bool, detail: str) -> bool:
    print(f"- {label}: {detail} -> {'met' if ok else 'MISSED'}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="skip the 100,000-request speed run")
    args = parser.parse_args()
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        azure = load_scenario(convert_azure(TRACES / "azure_llm_code_2023.csv", Path(tmp) / "azure"))
        results = [simulate(azure, p) for p in POLICIES]
        table("Azure LLM code 2023, mixed single GPU (`modelforge trace azure`)", results)
        mine, _, ollama = results
        prod = "production"
        print("\nTargets against the ollama baseline, same run:")
        ok &= check("invariant violations", mine.invariant_violations == 0, str(mine.invariant_violations))
        ok &= check("oom events", mine.oom_events == 0, str(mine.oom_events))
        # Over every production call (one never served waits forever: None) and over served ones.
        for label, key in (("every call", "wait_p99_s"), ("calls served", "served_wait_p99_s")):
            mine_p99, ollama_p99 = mine.by_class[prod][key], ollama.by_class[prod][key]
            ok &= check(
                f"production p99 wait, {label}",
                mine_p99 is not None and (ollama_p99 is None or mine_p99 <= 0.7 * ollama_p99),
                f"{seconds(mine_p99)} vs {seconds(ollama_p99)}, ratio {ratio_of(mine_p99, ollama_p99)} (<= 0.7)",
            )
        ok &= check(
            "model loads",
            mine.loads <= ollama.loads,
            f"{mine.loads} vs {ollama.loads}, ratio {mine.loads / ollama.loads:.3f}",
        )
        ratio = mine.vram_utilization / ollama.vram_utilization
        ok &= check(
            f"VRAM utilization over the common span ({mine.span_s:,.0f} s)",
            ratio >= 0.95,
            f"{mine.vram_utilization:.3f} vs {ollama.vram_utilization:.3f}, ratio {ratio:.3f} (>= 0.95)",
        )

        alibaba = load_scenario(
            convert_alibaba(
                TRACES / "alibaba_gpu_2023_nodes.csv",
                TRACES / "alibaba_gpu_2023_pods_default.csv",
                Path(tmp) / "alibaba",
                AlibabaOptions(nodes=8),
            )
        )
        results = [simulate(alibaba, p) for p in POLICIES]
        table("Alibaba GPU 2023, all GPU pods on 8 nodes / 30 GPUs (`modelforge trace alibaba --nodes 8`)", results)
        ok &= check("invariant violations", results[0].invariant_violations == 0, str(results[0].invariant_violations))
        ok &= check(
            "gang jobs split across NVLink groups",
            results[0].gang_splits == 0,
            f"{results[0].gang_splits} of {results[0].gang_starts} gang starts",
        )
        refused = results[1].rejected.get("CAPABILITY_UNAVAILABLE", 0)
        print(f"- the baselines place single-GPU work only: {refused} gang jobs refused by each")

        if not args.quick:
            big = load_scenario(
                convert_azure(TRACES / "azure_llm_code_2023.csv", Path(tmp) / "big", AzureOptions(repeat=9))
            )
            print(f"\n## Replay speed: Azure tiled 9 times, {len(big.requests):,} requests\n")
            speed = [simulate(big, p) for p in POLICIES]
            for result in speed:
                print(f"- {result.policy}: {result.wall_s:.1f} s, {result.requests_per_s:,.0f} requests/s")
            fastest = max(speed[1:], key=lambda r: r.requests_per_s)
            print(
                f"- modelforge replays at {speed[0].requests_per_s / fastest.requests_per_s:.3f}x the fastest baseline"
            )
            ok &= check("100,000 requests in <= 30 s", speed[0].wall_s <= 30.0, f"{speed[0].wall_s:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
