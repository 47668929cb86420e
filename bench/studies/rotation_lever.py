"""The rotation lever (issue 17): llm-compressor's QuIP input-side Hadamard rotation before
a recipe's quantization, measured like every other recipe (`qship compare`, exact KL).

qship's recipe schema has no rotation field: rotations did not earn one (bench/RESULTS.md,
"The quality frontier"). This script prepends `QuIPModifier(rotations=["v"])` to the
modifiers qship builds from the recipe, under a recipe name of its own (`<name>-quip`, so
the stage cache keeps the two apart), and runs the same compare.

    python bench/studies/rotation_lever.py --model SRC --recipe R.yaml --out DIR [--block 128]
        [--cache-dir C] [--device cuda]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipeline.compare import compare  # noqa: E402
from pipeline.quantize import engine, modifiers  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--recipe", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--block", type=int, default=128, help="Hadamard block (divides every width)")
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "qship")
    ap.add_argument("--device", default=None)
    a = ap.parse_args()
    from llmcompressor.modifiers.transform import QuIPModifier

    data = yaml.safe_load(a.recipe.read_text())
    data["name"] = f"{data['name']}-quip{a.block}"
    a.out.mkdir(parents=True, exist_ok=True)
    rp = a.out / f"{data['name']}.yaml"
    rp.write_text(yaml.safe_dump(data, sort_keys=False))
    build = modifiers.build_modifiers

    def with_rotation(plan, recipe):
        return [QuIPModifier(rotations=["v"], transform_type="random-hadamard",
                             transform_block_size=a.block, ignore=["lm_head"]),
                *build(plan, recipe)]  # fmt: skip

    check = engine.check_saved

    def check_rotated(out_dir, plan):
        # qship's validator does not know the online rotation tensors (`*.v_input.weight`):
        # accept that complaint alone; transformers still reloads the checkpoint and its
        # logits are checked (verify_reload), and evaluate measures it
        from pipeline.errors import StageError
        from pipeline.model.checkpoint import CheckpointInspection

        try:
            return check(out_dir, plan)
        except StageError as e:
            lines = [x for x in str(e).splitlines() if x.strip().startswith("- ")]
            if not lines or not all("v_input.weight: not a tensor" in x for x in lines):
                raise
            return CheckpointInspection(
                architecture="rotated", schemes={m.name: m.scheme for m in plan.modules
                                                 if m.scheme}, kv_cache=plan.kv_cache is not None,
                format=None, config_groups=0, tensors=0, bytes=0,
            )  # fmt: skip

    engine.build_modifiers = with_rotation  # type: ignore[attr-defined]
    engine.check_saved = check_rotated  # type: ignore[attr-defined]
    res = compare.compare(a.model, [rp], a.out / "runs", cache_dir=a.cache_dir, device=a.device,
                          exact=True)  # fmt: skip
    print(res.summary())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
