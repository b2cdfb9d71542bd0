"""The repository explains itself: no tracked code, help text or doc cites something a reader of
the repository cannot open (a tracker issue or finding by number, a work session, an outside
design document or its sections, the product owner's original documents and their milestones).
Say the thing itself instead, or point at the repo's own docs (docs/ARCHITECTURE.md, the README)
or at the release a change arrived with (CHANGELOG.md, tests/histories/<version>).

Recorded histories (tests/histories/) and data files (data/) are copies of outside material and
are not read; neither are binary files or this file (it names the patterns)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SKIPPED_PREFIXES = ("tests/histories/", "data/")
THIS_FILE = Path(__file__).resolve().relative_to(ROOT).as_posix()

OUTSIDE_REFERENCES = re.compile(
    r"""
      \bissues?\ [0-9]                  # "issue 20 item 1", "(issue 3)", "issues 4 and 5"
    | \bissue\ finding\b                # "(issue finding 9)"
    | \bthe\ issue'?s\b                 # "the issue's targets"
    | \bsessions?\ [0-9]                # "from session 6 on", "before session 7"
    | \bseed[\ -]00[0-9]                # "Seed 000, M5:", "seed 003's", "the seed-000 model"
    | \bthe\ seed(?:'s)?\b              # "the seed's formula", "the seed reserves" (not "the seeds")
    | \bseeds/                          # the product owner's documents folder
    | \bDESIGN\.md\b                    # a design document outside the repository
    | §                                 # its sections
    """,
    re.IGNORECASE | re.VERBOSE,
)
# The owner's milestones ("M5", "M6"); case-sensitive, so "m5" in other words stays allowed.
MILESTONE = re.compile(r"\bM[0-9]\b")
# "seed" as a random seed stays: a trace's seed, `--seed`, an OpenAI `seed` parameter, hypothesis.
RANDOM_SEED = re.compile(r"random seed|--seed|seed=|_seed|seed_a|seed_b", re.IGNORECASE)


def outside_references(path: str, text: str) -> list[str]:
    """`path:line: text` for every line of `text` that cites something outside the repository."""
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        matches = [m.group() for m in OUTSIDE_REFERENCES.finditer(line)] + MILESTONE.findall(line)
        if RANDOM_SEED.search(line):  # a seed on a random seed's line is that seed; the rest still counts
            matches = [m for m in matches if "seed" not in m.lower()]
        if matches:
            found.append(f"{path}:{number}: {line.strip()}")
    return found


def tracked_text_files() -> list[tuple[str, str]]:
    git = shutil.which("git")
    assert git is not None, "git is needed to list the tracked files"
    listed = subprocess.run([git, "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    files = []
    for name in listed.decode().split("\0"):
        if not name or name.startswith(SKIPPED_PREFIXES) or name == THIS_FILE:
            continue
        path = ROOT / name
        if not path.is_file():  # deleted in the working tree, not yet committed
            continue
        raw = path.read_bytes()
        if b"\0" in raw[:8192]:
            continue
        try:
            files.append((name, raw.decode("utf-8")))
        except UnicodeDecodeError:
            continue
    return files


def test_the_patterns_catch_outside_references_and_spare_random_seeds() -> None:
    cited = [
        "### Gang placement (issue 20 item 1, 2026-12-01)",
        "Targets (issue 8), checked and printed",
        "with the issue's targets checked",
        "A request id is the request's idempotency key (issue finding 9)",
        "the request workflows ran them from session 6 on",
        "# Seed 000, M5: rag.embedding@1",
        "Seed 003's queues.",
        "the seed's formula",
        "Accepted spellings that the seed reserves for later",
        "The admission invariant of DESIGN.md section 3",
        "always_warm deployments (DESIGN §4)",
        "the owner's milestone M6",
        "with seed=7 as in issue 3",
    ]
    assert [line for line in cited if not outside_references("x", line)] == []
    spared = [
        "def derived_layer(seed: int, index: int, dim: int) -> np.ndarray:",
        "two real fine-tunes of the base's shape instead of the seeds.",
        "`--seed-a 1`, `--seed-b 2`",
        "python -m bench.chaos --minutes 5 --rate 3 --seed 1",
        'messages=[{"role": "system", "content": "be brief"}], seed=7',
        "# Seed 14's first four faults are one of each kind",
        "modelforge/examples/queues-seed003.toml",
        "stage 5 `4214797` (decision cost, replay speed)",
        "H100 m5.xlarge",
    ]
    assert [line for line in spared if outside_references("x", line)] == []


def test_no_tracked_file_points_outside_the_repository() -> None:
    files = tracked_text_files()
    assert len(files) > 100  # the listing worked
    found = [hit for name, text in files for hit in outside_references(name, text)]
    assert found == [], "cite the repository's own docs instead:\n" + "\n".join(found)
