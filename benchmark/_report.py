"""Writing a benchmark's results: JSON (meta + rows) and a markdown table."""

import json
import os
from typing import Dict, List


def write_report(out: str, meta: Dict, rows: List[Dict], table: str) -> None:
    """Writes ``out + ".json"`` and ``out + ".md"``, creating the folder."""
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    with open(out + ".md", "w") as f:
        f.write(table)
