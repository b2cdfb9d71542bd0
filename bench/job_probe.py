"""A tiny `subprocess_job` for bench/jobs.py: it records the moment it starts and each progress
line it prints (wall clock, appended as JSON lines to `--marks FILE`), checkpoints after every
step into MODELFORGE_CHECKPOINT_DIR, and on SIGTERM stops after the step at hand and exits 75;
resumed (MODELFORGE_RESUME_FROM), its first line of progress comes before any more work.

    python -m bench.job_probe --marks FILE [--steps 1] [--step-delay-s 0]

Only the standard library, and the first mark is taken before anything else is imported."""

import time

STARTED = time.time()

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402

_stop = False


def _on_signal(signum: int, frame: object) -> None:
    global _stop
    _stop = True
    mark("signal")


MARKS = ""


def mark(event: str, **fields: object) -> None:
    if MARKS:
        line = {"event": event, "at": time.time(), "attempt": os.environ.get("MODELFORGE_ATTEMPT", ""), **fields}
        with open(MARKS, "a") as stream:
            stream.write(json.dumps(line) + "\n")


def main() -> int:
    global MARKS
    argv = sys.argv[1:]
    options = {"--marks": "", "--steps": "1", "--step-delay-s": "0"}
    while argv:
        name = argv.pop(0)
        if name not in options or not argv:
            print(f"usage: {__doc__.splitlines()[-3].strip()}", file=sys.stderr)
            return 2
        options[name] = argv.pop(0)
    MARKS = options["--marks"]
    steps, delay = int(options["--steps"]), float(options["--step-delay-s"])
    print(json.dumps({"message": "started", "at": STARTED}), flush=True)
    if MARKS:
        line = {"event": "start", "at": STARTED, "attempt": os.environ.get("MODELFORGE_ATTEMPT", "")}
        with open(MARKS, "a") as stream:
            stream.write(json.dumps(line) + "\n")
    signal.signal(signal.SIGTERM, _on_signal)
    checkpoints = os.environ.get("MODELFORGE_CHECKPOINT_DIR", "probe-out")
    os.makedirs(checkpoints, exist_ok=True)
    state_path = os.path.join(checkpoints, "state.json")
    done = 0
    resume = os.environ.get("MODELFORGE_RESUME_FROM", "")
    if resume:
        with open(os.path.join(resume, "state.json") if os.path.isdir(resume) else resume) as stream:
            done = int(json.load(stream)["steps_done"])
        print(json.dumps({"progress": done / steps, "message": f"resumed after step {done}"}), flush=True)
        mark("progress", step=done, resumed=True)
    for step in range(done, steps):
        waited = 0.0
        while waited < delay and not _stop:
            time.sleep(min(0.01, delay - waited))
            waited += 0.01
        with open(state_path + ".tmp", "w") as stream:
            json.dump({"steps_done": step + 1, "steps": steps}, stream)
        os.replace(state_path + ".tmp", state_path)
        print(json.dumps({"progress": (step + 1) / steps, "message": f"step {step + 1}", "checkpoint": state_path}))
        sys.stdout.flush()
        mark("progress", step=step + 1, resumed=bool(resume))
        if _stop and step + 1 < steps:
            mark("checkpointed", step=step + 1)
            return 75
    print(json.dumps({"progress": 1.0, "message": "done", "result": {"steps": steps}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
