"""Recipe variants for bench/device/frontier_session.sh (YAML in, YAML out).

python bench/device/frontier_session.py notask DIR R.yaml...   # benchmark tasks removed (KL only)
python bench/device/frontier_session.py tasks DIR R.yaml...    # six benchmark subsets, 1,000 items each
python bench/device/frontier_session.py nogate DIR R.yaml...   # KL only, no gates (to package and serve)
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

TASKS = ["hellaswag", "arc_easy", "arc_challenge", "piqa", "winogrande", "lambada_openai"]


def main(mode: str, out: str, *recipes: str) -> None:
    Path(out).mkdir(parents=True, exist_ok=True)
    for p in recipes:
        d = yaml.safe_load(Path(p).read_text())
        if mode == "tasks":
            d["name"] += "-tasks"
            d["evaluation"].update(tasks=TASKS, hub_tasks=[], limit=1000, task_batch_size=32)
            d["gates"] = {}
        else:
            d["evaluation"].update(tasks=[], hub_tasks=[])
        if mode == "nogate":
            d["gates"] = {}
        Path(out, f"{d['name']}.yaml").write_text(yaml.safe_dump(d, sort_keys=False))


if __name__ == "__main__":
    main(*sys.argv[1:])
