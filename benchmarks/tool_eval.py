"""Tool-use evaluation of a served model on held-out tasks, as a new user would run it: a real
`musespark serve --reasoning-parser muse --enable-auto-tool-choice --tool-call-parser muse`, the
official `openai` client, greedy (temperature 0).

    python benchmarks/tool_eval.py --limit 30                        # the bundled model, 30 tool tasks
    python benchmarks/tool_eval.py --dtype float32                   # served in float32, as its card scores it
    python benchmarks/tool_eval.py --tasks tasks.jsonl --model DIR   # tasks from tools/muse_copy_data.py
    python benchmarks/tool_eval.py --base-url http://127.0.0.1:8000/v1 --served-model-name NAME

Tasks are JSON lines as `tools/muse_copy_data.py tasks` writes them (without --tasks the same
generator makes them, --seed 1000); their values never occur in the training data. Reported:

* right_tool: the first tool call names the expected tool;
* exact_arguments: its arguments, JSON-parsed, equal the expected ones (an expression may
  differ in whitespace only);
* restate: with the expected call and the tool's result sent back (the task's `followup`), the
  answer holds the result's key values (weather: temperature and conditions; calculator: the
  number; read_file: one line of the file; an error: its reason; a number not inside a longer one);
* plain_no_call: plain chat answered with content and no call;
* no_tool_refusal: a question whose tool is not offered answered with no call and a refusal.

Human-readable lines first (the first failures of each kind), then ONE JSON line last.
This is a benchmark, not a training step: it lives beside the other measurements of the
served model (`benchmarks/`), while `tools/` holds the recipe that makes the model.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SERVE_FLAGS = ("--reasoning-parser", "muse", "--enable-auto-tool-choice", "--tool-call-parser", "muse")
REFUSAL = re.compile(r"\b(can't|cannot|can not|unable|don't have|do not have|not available|no \w+ tool)\b", re.I)


# -- scoring (pure functions of a task and the response) --------------------------------------


def _normal(name: str, args: Any) -> Any:
    """Arguments as compared: a calculator expression without its whitespace."""
    if name == "calculator" and isinstance(args, dict) and isinstance(args.get("expression"), str):
        return {**args, "expression": re.sub(r"\s+", "", args["expression"])}
    return args


def score_call(task: dict[str, Any], calls: list[tuple[str, str]]) -> tuple[bool, bool]:
    """(right tool, exact arguments) for the response's calls as (name, arguments JSON text)."""
    if not calls:
        return False, False
    name, arguments = calls[0]
    expected = task["expected"]
    if name != expected["name"]:
        return False, False
    try:
        args = json.loads(arguments)
    except (TypeError, ValueError):
        return True, False
    return True, _normal(name, args) == _normal(name, expected["arguments"])


def _has_value(text: str, value: str) -> bool:
    """`value` occurs in `text`: a number not as a part of a longer number ("18" in "18C", not
    in "118" or "-18"), anything else as a case-insensitive substring."""
    if re.fullmatch(r"-?\d+(\.\d+)?", value):
        return re.search(rf"(?<![\d.\-]){re.escape(value)}(?!\d|\.\d)", text) is not None
    return value.lower() in text.lower()


def restates(task: dict[str, Any], answer: str | None) -> bool:
    want = task["restate"]
    text = answer or ""
    if "all" in want:
        return all(_has_value(text, v) for v in want["all"])
    return any(_has_value(text, v) for v in want["any"])


def refuses(content: str | None, calls: list[tuple[str, str]]) -> bool:
    return not calls and REFUSAL.search(content or "") is not None


def plain_ok(content: str | None, calls: list[tuple[str, str]]) -> bool:
    return not calls and bool((content or "").strip())


# -- running ------------------------------------------------------------------------------------


def load_tasks(path: str | None, seed: int) -> list[dict[str, Any]]:
    if path:
        return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    sys.path.insert(0, str(ROOT / "tools"))
    import muse_copy_data

    return muse_copy_data.eval_tasks(seed)


def limit_tasks(tasks: list[dict[str, Any]], limit: int | None) -> list[dict[str, Any]]:
    """The first `limit` tool tasks and the first limit/4 (at least 1) of each other kind."""
    if limit is None:
        return tasks
    quota = {"tool": limit, "plain": max(1, limit // 4), "no_tool": max(1, limit // 4)}
    out = []
    for t in tasks:
        if quota.get(t["kind"], 0) > 0:
            quota[t["kind"]] -= 1
            out.append(t)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    model: str | None, log: Path, timeout: float, dtype: str | None = None
) -> tuple[subprocess.Popen, str]:
    """`musespark serve` with the Muse parsers (and `--dtype dtype`, if given) on a free port;
    (process, base URL) once healthy."""
    import httpx

    port = _free_port()
    cmd = [sys.executable, "-m", "musespark", "serve", *([model] if model else []), "--port", str(port)]
    cmd += [
        *SERVE_FLAGS,
        *(["--dtype", dtype] if dtype else []),
        "--disable-log-requests",
        "--uvicorn-log-level",
        "warning",
    ]
    paths = [str(ROOT / "src"), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"musespark serve exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, f"{url}/v1"
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    stop_server(proc)
    raise RuntimeError(f"musespark serve was not healthy within {timeout:.0f} s")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)  # its own session: the server and any workers it started
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def ask(client: Any, model: str, task: dict[str, Any], messages: list, max_tokens: int) -> tuple[str | None, list]:
    """One greedy chat completion: (content, [(name, arguments), ...])."""
    r = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=task.get("tools") or None,
        temperature=0,
        max_tokens=max_tokens,
        extra_body={"chat_template_kwargs": task.get("chat_template_kwargs") or {}},
    )
    msg = r.choices[0].message
    return msg.content, [(c.function.name, c.function.arguments) for c in msg.tool_calls or []]


Response = tuple[str | None, list[tuple[str, str]]]  # (content, [(tool name, arguments JSON text), ...])


def evaluate(client: Any, model: str, tasks: list[dict[str, Any]], max_tokens: int, show: int) -> dict[str, Any]:
    """Ask the served model every task (and each tool task's follow-up), then score."""
    first: dict[str, Response] = {}
    followup: dict[str, str | None] = {}
    for task in tasks:
        first[task["id"]] = ask(client, model, task, task["messages"], max_tokens)
        if task["kind"] == "tool":
            followup[task["id"]] = ask(client, model, task, task["messages"] + task["followup"], max_tokens)[0]
    return score_responses(tasks, first, followup, show)


def score_responses(
    tasks: list[dict[str, Any]], first: dict[str, Response], followup: dict[str, str | None], show: int = 3
) -> dict[str, Any]:
    """The rates for `tasks`, from each task's first response (`first[id]`) and, for a tool task,
    the answer after the expected call and the tool's result were sent back (`followup[id]`).
    Prints the first `show` failures of each kind. tools/finetune_muse.py scores the model it
    exports with this too, on responses generated in-process."""
    hits: dict[str, list[bool]] = {k: [] for k in ("right_tool", "exact_arguments", "restate", "plain", "no_tool")}
    by_tool: dict[str, list[int]] = {}
    failures: dict[str, int] = {}

    def note(kind: str, task: dict[str, Any], got: Any) -> None:
        failures[kind] = failures.get(kind, 0) + 1
        if failures[kind] <= show:
            user = next(m["content"] for m in reversed(task["messages"]) if m["role"] == "user")
            print(f"  {kind} miss [{task['id']}] {user!r} -> {got!r}", flush=True)

    for task in tasks:
        content, calls = first[task["id"]]
        if task["kind"] == "tool":
            right, exact = score_call(task, calls)
            hits["right_tool"].append(right)
            hits["exact_arguments"].append(exact)
            by_tool.setdefault(task["expected"]["name"], [0, 0])[0] += exact
            by_tool[task["expected"]["name"]][1] += 1
            if not exact:
                note("arguments", task, calls[:1] or content)
            answer = followup[task["id"]]
            hits["restate"].append(restates(task, answer))
            if not hits["restate"][-1]:
                note("restate", task, answer)
        elif task["kind"] == "plain":
            hits["plain"].append(plain_ok(content, calls))
            if not hits["plain"][-1]:
                note("plain", task, calls[:1] or content)
        else:
            hits["no_tool"].append(refuses(content, calls))
            if not hits["no_tool"][-1]:
                note("no_tool", task, calls[:1] or content)

    def pct(xs: list[bool]) -> float | None:
        return round(100 * sum(xs) / len(xs), 1) if xs else None

    return {
        "tool_tasks": len(hits["right_tool"]),
        "right_tool_pct": pct(hits["right_tool"]),
        "exact_arguments_pct": pct(hits["exact_arguments"]),
        "restate_pct": pct(hits["restate"]),
        "plain_tasks": len(hits["plain"]),
        "plain_no_call_pct": pct(hits["plain"]),
        "no_tool_tasks": len(hits["no_tool"]),
        "no_tool_refusal_pct": pct(hits["no_tool"]),
        "exact_arguments_by_tool": by_tool,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", default=None, help="a JSONL file of tasks (default: generated, --seed)")
    p.add_argument("--seed", type=int, default=1000, help="the held-out generator's seed (without --tasks)")
    p.add_argument("--limit", type=int, default=None, help="at most N tool tasks and N/4 of each other kind")
    p.add_argument("--model", default=None, help="the checkpoint to serve (default: the bundled model)")
    p.add_argument("--base-url", default=None, help="evaluate a running server instead of starting one")
    p.add_argument("--api-key", default="EMPTY")
    p.add_argument("--served-model-name", default=None, help="with --base-url: the model name (default: the first)")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--show", type=int, default=3, help="print the first N failures of each kind")
    p.add_argument("--startup-timeout", type=float, default=300)
    p.add_argument("--dtype", default=None, help="the started server's --dtype (default: its own, the checkpoint's)")
    args = p.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        p.error("--limit must be at least 1")

    import openai

    tasks = limit_tasks(load_tasks(args.tasks, args.seed), args.limit)
    proc = None
    t0 = time.monotonic()
    base_url = args.base_url
    try:
        if base_url is None:
            log = Path(tempfile.gettempdir()) / f"tool_eval_serve_{os.getpid()}.log"
            proc, base_url = start_server(args.model, log, args.startup_timeout, args.dtype)
        client = openai.OpenAI(base_url=base_url, api_key=args.api_key, max_retries=0, timeout=300)
        model = args.served_model_name or client.models.list().data[0].id
        print(f"evaluating {model} at {base_url} on {len(tasks)} tasks", flush=True)
        result = evaluate(client, model, tasks, args.max_tokens, args.show)
    finally:
        if proc is not None:
            stop_server(proc)
    result.update(
        model=model,
        dtype=args.dtype or ("auto" if args.base_url is None else "unknown"),
        tasks=args.tasks or f"muse_copy_data.eval_tasks({args.seed})",
    )
    result["seconds"] = round(time.monotonic() - t0, 1)
    sys.path.insert(0, str(ROOT / "src"))
    from musespark.bench.common import print_json

    print_json(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
