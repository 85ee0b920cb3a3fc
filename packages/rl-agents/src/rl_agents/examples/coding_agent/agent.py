"""A small tool-using coding agent written against the official ``openai`` client. It knows
nothing about training: run it against any OpenAI-compatible endpoint.

::

    OPENAI_BASE_URL=... OPENAI_API_KEY=... RL_TASK='{"input": "Write add(a, b) ..."}' \\
        python -m rl_agents.examples.coding_agent.agent

It reads the task (``RL_TASK`` JSON, or stdin), then loops: ask the model, run the tool calls it
makes, send the results back, until the model answers without a call or ``AGENT_MAX_TURNS``
model calls are spent. Tools:

- ``write_file(path, content)``: write a file in the workspace (``AGENT_WORKSPACE``, default the
  working directory); paths outside it are refused.
- ``run_shell(command)``: run a shell command in the workspace, return its exit status and
  output. With ``AGENT_SHELL_PREFIX`` set (e.g. ``python -m rl_agents.tools --root DIR --``),
  the command runs through that prefix (a sandbox) as ``PREFIX sh -c COMMAND``.

It prints one JSON line at the end: ``{"turns": n, "tool_calls": k, "final": "..."}``.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import openai

SYSTEM = (
    "You are a coding agent. Solve the task by writing Python files with write_file and "
    "checking them with run_shell. When the code works, reply with a short summary and no tool "
    "call."
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Write a text file in the workspace (overwrites it).",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                "required": ["path", "content"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_shell",
            "description": "Run a shell command in the workspace; returns exit code and output.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    },
]

_OUTPUT_CHARS = 2000


def write_file(workspace: Path, path: str, content: str) -> str:
    """The write_file tool."""
    target = (workspace / path).resolve()
    if not target.is_relative_to(workspace):
        return f"error: {path!r} is outside the workspace"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(content)
    return f"wrote {len(content)} characters to {path}"


def run_shell(workspace: Path, command: str, prefix: list[str], timeout_s: float) -> str:
    """The run_shell tool."""
    argv = [*prefix, "sh", "-c", command] if prefix else ["sh", "-c", command]
    try:
        proc = subprocess.run(
            argv, cwd=workspace, capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return f"error: timed out after {timeout_s}s"
    out = (proc.stdout + proc.stderr)[-_OUTPUT_CHARS:]
    return f"exit code {proc.returncode}\n{out}"


def call_tool(name: str, arguments: str, workspace: Path, prefix: list[str]) -> str:
    """Run one tool call; errors become the tool's answer (the model can react to them)."""
    try:
        args = json.loads(arguments or "{}")
        if name == "write_file":
            return write_file(workspace, str(args["path"]), str(args["content"]))
        if name == "run_shell":
            return run_shell(workspace, str(args["command"]), prefix, 60.0)
        return f"error: unknown tool {name!r}"
    except (json.JSONDecodeError, KeyError, TypeError, OSError) as e:
        return f"error: {type(e).__name__}: {e}"


def main() -> int:
    """Run the agent once (see the module docstring)."""
    raw = os.environ.get("RL_TASK") or sys.stdin.read()
    task = json.loads(raw)
    workspace = Path(os.environ.get("AGENT_WORKSPACE", ".")).resolve()
    prefix = shlex.split(os.environ.get("AGENT_SHELL_PREFIX", ""))
    max_turns = int(os.environ.get("AGENT_MAX_TURNS", "6"))
    max_tokens = int(os.environ.get("AGENT_MAX_TOKENS", "512"))
    model = os.environ.get("AGENT_MODEL", "policy")
    client = openai.OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY from the env
    messages: list[dict] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": str(task["input"])},
    ]
    turns = calls = 0
    final = ""
    while turns < max_turns:
        reply = client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, max_tokens=max_tokens
        )
        turns += 1
        msg = reply.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            final = msg.content or ""
            break
        for call in msg.tool_calls:
            calls += 1
            result = call_tool(call.function.name, call.function.arguments, workspace, prefix)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    print(json.dumps({"turns": turns, "tool_calls": calls, "final": final[-500:]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
