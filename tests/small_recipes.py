"""Shipped recipes shrunk for the tiny test models (imported by tests, like cli_run)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def small_recipe(dest_dir: Path, base: str, samples: int = 8) -> Path:
    """recipes/<base>.yaml as `<base>-small`: `samples` x 128 calibration tokens, 8 x 128
    held-out, no KV scheme (weights only), no benchmarks, a gate any tiny model passes."""
    import yaml

    d = yaml.safe_load((ROOT / "recipes" / f"{base}.yaml").read_text())
    d["name"] = f"{base}-small"
    d["kv_cache"] = None
    d.setdefault("calibration", {}).update(num_samples=samples, seq_len=128, batch_size=samples)
    d["evaluation"].update(sequences=8, seq_len=128, tasks=[], hub_tasks=[])
    d["gates"] = {"kl_mean_max": 10.0}
    p = Path(dest_dir) / f"{base}-small.yaml"
    p.write_text(yaml.safe_dump(d, sort_keys=False))
    return p


def stored_format(checkpoint: Path) -> dict:
    """A checkpoint's quantization_config without what differs between equal formats (the
    library version, the measured compression ratio)."""
    import json

    c = json.loads((Path(checkpoint) / "config.json").read_text())["quantization_config"]
    return {k: v for k, v in c.items() if k not in ("version", "global_compression_ratio")}
