"""rl-hf as a distribution: its entry points name the `hf` backends, and importing it is lazy."""

from __future__ import annotations

import subprocess
import sys

from rl_core import registry


def test_hf_entry_points_resolve_to_rl_hf():
    """`type: hf` still names the transformers backend for policy, critic and generator."""
    from rl_hf.critic import HFCritic
    from rl_hf.generator import HFGenerator
    from rl_hf.policy import HFPolicy

    assert registry.resolve("rl.policies", "hf") is HFPolicy
    assert registry.resolve("rl.critics", "hf") is HFCritic
    assert registry.resolve("rl.generators", "hf") is HFGenerator


def test_import_is_lazy_and_versioned():
    """`import rl_hf` pulls in neither transformers nor the backends until a name is used."""
    code = (
        "import sys, rl_hf, rl_core\n"
        "assert rl_hf.__version__ == rl_core.__version__, (rl_hf.__version__, rl_core.__version__)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'"
        " or m.startswith('rl_hf.policy')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
