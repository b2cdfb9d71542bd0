"""One trace replayed by another commit's code and by this tree's, side by side in one run: the
commit checked out in a git worktree, the two alternating, each replay in a process of its own.
A change to the policy is measured against the code it changed on the same machine in the same
minutes (this machine's speed moves by a third from one hour to the next, so figures from two
runs are not comparable). Each replay's outcome is compared too, an md5 over every request's
first start, end, outcome and served seconds (`busy`) or every request's wait and every figure
of the comparison (`whatif`): a change made for speed must decide the same.

    .venv/bin/python -m bench.side_by_side busy --base 979411c     # bench.busy_cluster's trace
    .venv/bin/python -m bench.side_by_side whatif --base 979411c   # one replay of bench.whatif's record
    .venv/bin/python -m bench.side_by_side busy --base HEAD~1 --pairs 2

`busy`: ModelForge's replay of the busy Alibaba cluster alone, as `bench.simulate --busy` runs it
(about 2 minutes a replay on the 2-core machine). `whatif`: the week's record is made once by
this tree (about 2-3 minutes), then replayed as it was (about 1-2.5 minutes a replay). The base
must read the scenario this tree writes (a commit of the same scenario format). Exit status 1
when the two decide differently.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _child(case: str, source: str) -> dict[str, object]:
    """One replay by the code on PYTHONPATH (the parent sets it to the tree being measured)."""
    import gc

    if case == "busy":
        from modelforge.simulate import POLICIES, load_scenario
        from modelforge.simulate._engine import Simulation

        scenario = load_scenario(Path(source))
        gc.collect()
        started = time.perf_counter()
        sim = Simulation(scenario, POLICIES["modelforge"](scenario))
        sim.run()
        wall = time.perf_counter() - started
        seen = repr([(o.first_start, o.ended, o.outcome, o.served_s) for o in sim.outcomes])
    else:
        from modelforge.simulate._whatif import replay

        with open(source, "rb") as handle:
            record = pickle.load(handle)
        gc.collect()
        started = time.perf_counter()
        replayed = replay(record, None, "as it was")
        wall = time.perf_counter() - started
        # (the figures less the replay's own wall time)
        figures = {name: value for name, value in replayed.figures.items() if not name.endswith("wall_s")}
        seen = json.dumps([sorted(replayed.waits.items()), figures], sort_keys=True, default=str)
    import modelforge

    return {
        "wall_s": round(wall, 2),
        "md5": hashlib.md5(seen.encode()).hexdigest(),
        "code": str(Path(modelforge.__file__).resolve().parents[1]),
    }


def _busy_trace(folder: Path) -> str:
    from bench.busy_cluster import busy_scenario

    path, _ = busy_scenario(folder / "busy")
    return str(path)


def _whatif_record(folder: Path) -> str:
    from bench.whatif import START_EPOCH, homelab_week, record_window
    from modelforge.simulate import build_record_scenario
    from modelforge.simulate._recorder import make_record, record_rows

    scenario = homelab_week(2)
    started = time.perf_counter()
    record = make_record(scenario, START_EPOCH)
    print(f"the week's record made by this tree: {len(record.events):,} events ({time.perf_counter() - started:.1f} s)")
    since, until = record_window()
    replayed = build_record_scenario(
        record_rows(record), [(START_EPOCH - 1.0, scenario.catalog)], since_s=since, until_s=until
    )
    path = folder / "record.pickle"
    with path.open("wb") as handle:
        pickle.dump(replayed, handle)
    return str(path)


def _run(tree: Path, case: str, source: str) -> dict[str, object]:
    environment = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(  # noqa: S603 (this script, with an argument list of our own)
        [sys.executable, str(Path(__file__).resolve()), "--child", case, source],
        cwd=tree,
        env=environment,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"the replay by {tree} failed:\n{done.stderr[-4000:]}")
    found: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    if Path(str(found["code"])) != tree.resolve():
        raise SystemExit(f"the replay meant for {tree} ran the code in {found['code']}")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("case", choices=["busy", "whatif"])
    parser.add_argument("--base", required=True, help="the commit to measure this tree against")
    parser.add_argument("--pairs", type=int, default=3, help="replays of each, alternating (default 3)")
    if "--child" in sys.argv:
        _, _, case, source = sys.argv
        print(json.dumps(_child(case, source)))
        return 0
    args = parser.parse_args()
    if args.pairs < 1:
        parser.error("--pairs must be at least 1")
    commit = subprocess.run(  # noqa: S603 (an argument list of our own)
        ["git", "-C", str(ROOT), "rev-parse", "--verify", f"{args.base}^{{commit}}"],
        capture_output=True,
        text=True,
        check=False,
    )
    if commit.returncode != 0:
        parser.error(f"--base {args.base!r} is not a commit of this repository")
    base_commit = commit.stdout.strip()
    with tempfile.TemporaryDirectory(prefix="modelforge-side-by-side-") as folder:
        base = Path(folder) / "base"
        subprocess.run(  # noqa: S603 (an argument list of our own)
            ["git", "-C", str(ROOT), "worktree", "add", "--quiet", "--detach", str(base), base_commit], check=True
        )
        try:
            source = _busy_trace(Path(folder)) if args.case == "busy" else _whatif_record(Path(folder))
            walls: dict[str, list[float]] = {"base": [], "this tree": []}
            digests: dict[str, set[str]] = {"base": set(), "this tree": set()}
            for pair in range(args.pairs):
                for label, tree in (("base", base), ("this tree", ROOT)):
                    found = _run(tree, args.case, source)
                    walls[label].append(float(str(found["wall_s"])))
                    digests[label].add(str(found["md5"]))
                    print(f"pair {pair + 1}: {label:9} {found['wall_s']:>8} s  md5 {found['md5']}", flush=True)
        finally:
            remove = ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)]
            subprocess.run(remove, check=False)  # noqa: S603 (an argument list of our own)
    before, after = statistics.mean(walls["base"]), statistics.mean(walls["this tree"])
    same = len(digests["base"] | digests["this tree"]) == 1
    print(
        f"\n{args.case}: base {base_commit[:7]} mean {before:.1f} s, this tree mean {after:.1f} s:"
        f" {after / before:.3f}x ({(after / before - 1) * 100:+.1f}%), {args.pairs} alternating pairs;"
        f" outcomes {'identical' if same else 'DIFFERENT'}"
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
