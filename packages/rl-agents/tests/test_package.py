"""rl-agents as a distribution: its entry points, and an import that stays light."""

from __future__ import annotations

import subprocess
import sys

from rl_core import registry


def test_agent_entry_points_resolve_to_rl_agents():
    from rl_agents.examples.calculator import CalculatorRollout
    from rl_agents.rollout import AgentRollout, SessionReward

    assert registry.resolve("rl.generate_fns", "agent") is AgentRollout
    assert registry.resolve("rl.generate_fns", "calculator") is CalculatorRollout
    assert registry.resolve("rl.rewards", "session_reward") is SessionReward


def test_import_needs_neither_aiohttp_nor_transformers():
    """aiohttp is imported when a server starts, transformers never (the package is
    backend-agnostic: it serves any Generator)."""
    code = (
        "import sys, rl_agents, rl_agents.tools, rl_agents.trajectory, rl_agents.examples.calculator\n"
        "import rl_core\n"
        "assert rl_agents.__version__ == rl_core.__version__\n"
        "heavy = ('aiohttp', 'transformers', 'tokenizers', 'rl_hf')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_sandbox_command_and_agent_program_start_without_torch():
    """``python -m rl_agents.tools`` runs once per shell-tool call and the coding agent once per
    session: neither may pay for importing torch (the package imports lazily)."""
    code = (
        "import sys, rl_agents.tools, rl_agents.examples.coding_agent.agent\n"
        "print(sorted(m for m in ('torch', 'transformers', 'rl_core.interfaces') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
