"""Claude Code and Codex CLI themselves, unchanged, against ModelForge: a turn and a tool round each.

    npm install --prefix /tmp/agents @anthropic-ai/claude-code@2.1.332 @openai/codex@0.171.0  # ~800 MB
    .venv/bin/python scripts/agent_cli_check.py --agents /tmp/agents/node_modules/.bin

It starts `modelforge dev` (a simulated 24 GiB card whose chat model, `toy-chat`, is the project's
toy model server: a real HTTP server streaming tokens and calling tools) and `modelforge gateway`
on loopback, then runs, with nothing downloaded and no telemetry:
- `claude -p` (Anthropic's Messages API, streamed, `ANTHROPIC_BASE_URL` at the gateway): a
  greeting, then a prompt naming its `Read` tool, so the toy model calls it, Claude Code runs it
  (it fails: the toy's arguments are not a path) and sends the result back for a second turn;
- `codex exec` (the Responses API, streamed, a `model_providers` entry at the gateway's /v1): the
  same with its `exec_command` tool.
Each answer must come back (the agent exits 0 with the toy's answer), and on ModelForge's side
every call is in the gateway's access log, answered 200. Exit 0 when all of it held, 1 with what
went wrong otherwise.

Not in CI: the two agents are about 800 MB. tests/apps/test_agent_requests.py replays the first
request each sent, captured from these versions, in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _stack import gateway_requests, modelforge_stack, toy_catalog

MODEL = "toy-chat"
KEY = "sk-local-agent-check"


def claude(binary: Path, port: int, home: Path, prompt: str) -> tuple[str, int]:
    """Claude Code in print mode, streamed JSON out: (its final result, turns it took)."""
    env = {
        **os.environ,
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{port}",
        "ANTHROPIC_API_KEY": KEY,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL,  # its small model, for titles and the like
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
    }
    argv = [str(binary), "-p", prompt, "--model", MODEL, "--output-format", "stream-json", "--verbose"]
    done = subprocess.run(  # noqa: S603 (an argument list of our own)
        [*argv, "--max-turns", "4"], env=env, cwd=home, capture_output=True, text=True, timeout=180
    )
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    results = [line for line in lines if line.get("type") == "result"]
    if done.returncode or not results or results[-1].get("is_error"):
        raise SystemExit(f"claude -p {prompt!r} failed ({done.returncode}): {done.stdout[-800:]}{done.stderr[-800:]}")
    return str(results[-1]["result"]), int(results[-1]["num_turns"])


def codex(binary: Path, port: int, home: Path, prompt: str) -> str:
    """`codex exec` with a provider at the gateway's Responses API: its final message."""
    provider = f'{{name="ModelForge",base_url="http://127.0.0.1:{port}/v1",wire_api="responses",env_key="MF_KEY"}}'
    argv = [str(binary), "exec", "--skip-git-repo-check", "-c", "model_provider=modelforge"]
    argv += ["-c", f"model_providers.modelforge={provider}", "-m", MODEL, prompt]
    env = {**os.environ, "CODEX_HOME": str(home), "HOME": str(home), "MF_KEY": KEY}
    done = subprocess.run(  # noqa: S603 (an argument list of our own)
        argv, env=env, cwd=home, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL
    )
    if done.returncode or "[toy server]" not in done.stdout:
        raise SystemExit(f"codex exec {prompt!r} failed ({done.returncode}): {done.stdout[-800:]}{done.stderr[-800:]}")
    return done.stdout.strip().splitlines()[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=Path, required=True, help="the folder holding `claude` and `codex`")
    parser.add_argument("--keep", type=Path, default=None, help="keep logs and data in this directory")
    args = parser.parse_args()
    binaries = {name: args.agents / name for name in ("claude", "codex")}
    missing = [str(path) for path in binaries.values() if not path.exists()]
    if missing:
        raise SystemExit(f"not found: {', '.join(missing)} (the npm install in this script's docstring)")
    scratch = args.keep or Path(tempfile.mkdtemp(prefix="mf-agents-"))
    scratch.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    with modelforge_stack(toy_catalog(MODEL), scratch) as port:
        print(f"stack and gateway up in {time.monotonic() - began:.0f} s", flush=True)
        for name in ("claude-home", "codex-home"):
            (scratch / name).mkdir(exist_ok=True)
        said, turns = claude(binaries["claude"], port, scratch / "claude-home", "hello from claude code")
        print(f"claude -p: {turns} turn(s): {said[:90]!r}")
        said, turns = claude(binaries["claude"], port, scratch / "claude-home", "please use Read")
        print(f"claude -p with a tool round: {turns} turn(s): {said[:90]!r}")
        if turns < 2 or "Read" not in said:
            raise SystemExit("Claude Code did not run the Read tool and send its result back")
        print(f"codex exec: {codex(binaries['codex'], port, scratch / 'codex-home', 'hello from codex')[:90]!r}")
        said = codex(binaries["codex"], port, scratch / "codex-home", "please use exec_command")
        print(f"codex exec with a tool round: {said[:90]!r}")
        if "function arguments" not in said:
            raise SystemExit("Codex did not run exec_command and send its result back")
    served = [(r.get("route"), r.get("status"), r.get("tools_omitted")) for r in gateway_requests(scratch)]
    calls = [r for r in served if r[0] in ("/v1/messages", "/v1/responses")]
    print(f"gateway calls from the agents: {len(calls)}: " + ", ".join(f"{r} {s}" for r, s, _ in calls))
    print(f"logs: {scratch}")
    if len(calls) < 6 or any(status != 200 for _, status, _ in calls):  # 1 + 2 turns each
        raise SystemExit("not every agent call reached ModelForge as a 200")


if __name__ == "__main__":
    sys.exit(main())
