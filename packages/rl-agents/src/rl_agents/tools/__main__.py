"""``python -m rl_agents.tools --root DIR [--config JSON] -- ARGV...``: run one command in a
sandbox root (see :func:`rl_agents.tools.sandbox.main`)."""

import sys

from rl_agents.tools.sandbox import main

sys.exit(main())
