"""What the smaller benchmark scripts share: the machine record and writing the results file."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any


def write_results(path: Path, payload: dict[str, Any], load_before: tuple[float, ...]) -> None:
    """Write ``payload`` plus a ``machine`` record (platform, CPUs, load average before the run
    and now) as indented JSON to ``path``, and say so."""
    machine = {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "loadavg_before": list(load_before),
        "loadavg_after": list(os.getloadavg()),
    }
    path.write_text(json.dumps({**payload, "machine": machine}, indent=1) + "\n")
    print(f"wrote {path}")
