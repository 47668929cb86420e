"""Resume inside quantize: a run killed at decoder layer k keeps layers 0..k-1.

After llm-compressor's sequential pipeline finishes a decoder layer (its calibration pass,
AWQ's smoothing, GPTQ's compression), the layer's parameters and buffers -- quantized
weights, scales, zero points, KV scales -- and what qship measured on it go to
`<folder>/<index>.safetensors` and `.json` (written atomically; rank 0 under
torch.distributed). A rerun with the same inputs (the folder is named by the quantize stage
key) loads layers 0..k-1 from there instead of calibrating them and runs them forward,
hooks off, which rebuilds layer k's calibration inputs exactly; calibration resumes at k.
The folder is removed once the checkpoint is complete.

Nothing unverified is loaded: each layer's file has its sha256 beside it (`NNNN.sha256`,
written before the marker). A rerun loads layers up to the first whose file is missing,
truncated, altered or replaced; that layer and every later one are calibrated again, so
the checkpoint is the one an uninterrupted run writes.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .. import log
from ..compat.llmcompressor_0_14 import subgraph_forward_wrapped
from ..io.atomic import atomic_write_text
from ..io.hashing import sha256_file
from ..records.plan import Plan
from . import ranks

MANIFEST = "manifest.json"


def _versions() -> dict[str, str]:
    from importlib.metadata import version

    return {p: version(p) for p in ("llmcompressor", "compressed-tensors", "torch")}


class LayerStore:
    """The finished decoder layers of one quantize run (None folder: no resume)."""

    def __init__(self, folder: Path | None, plan: Plan):
        self.folder = folder
        self.layers = list(plan.decoder_layers)
        self.restorable = 0  # layers 0..restorable-1 are loaded instead of calibrated
        self.restored: set[str] = set()
        self.measured: dict[str, dict[str, Any]] = {}  # what was measured on each, as saved
        if folder is None:
            return
        manifest = {"layers": self.layers, "versions": _versions()}
        mf = folder / MANIFEST
        if mf.is_file() and json.loads(mf.read_text()) != manifest:
            log.detail(f"resume: {folder} is from another model or library version; dropped")
            if ranks.is_writer():
                shutil.rmtree(folder, ignore_errors=True)
        n = 0
        while n < len(self.layers) and (folder / f"{n:04d}.json").is_file():
            if not self._intact(n):
                log.info(f"  resume: stored decoder layer {n} fails its sha256 ({folder}); it "
                         "and the layers after it are calibrated again", style="yellow")  # fmt: skip
                break
            n += 1
        self.restorable = _agreed(n)
        if ranks.is_writer():
            folder.mkdir(parents=True, exist_ok=True)
            mf.write_text(json.dumps(manifest))
        if self.restorable:
            log.info(f"  resuming: decoder layers 0..{self.restorable - 1} of {len(self.layers)} "
                     f"are loaded from {folder}, not calibrated again", style="dim")  # fmt: skip

    def _intact(self, i: int) -> bool:
        """Layer i's file matches the sha256 recorded when it was written."""
        assert self.folder is not None
        f, d = self.folder / f"{i:04d}.safetensors", self.folder / f"{i:04d}.sha256"
        try:
            return f.is_file() and sha256_file(f).sha256 == d.read_text().strip()
        except OSError:
            return False

    def index(self, layer: str) -> int:
        return self.layers.index(layer) if layer in self.layers else -1

    def is_restorable(self, layer: str) -> bool:
        return 0 <= self.index(layer) < self.restorable

    def save(self, layer: str, module: torch.nn.Module, measured: dict[str, Any]) -> None:
        """Store a finished layer (rank 0; atomically: a kill mid-write leaves no file)."""
        i = self.index(layer)
        if self.folder is None or i < 0 or not ranks.is_writer():
            return
        from safetensors.torch import save_file

        state = {
            k: v.detach().to("cpu").contiguous().clone() for k, v in module.state_dict().items()
        }
        tmp = self.folder / f".{i:04d}.tmp"
        save_file(state, str(tmp))
        digest = sha256_file(tmp).sha256
        os.replace(tmp, self.folder / f"{i:04d}.safetensors")
        atomic_write_text(self.folder / f"{i:04d}.sha256", digest + "\n")
        meta = self.folder / f".{i:04d}.json.tmp"
        meta.write_text(json.dumps(measured))
        os.replace(meta, self.folder / f"{i:04d}.json")  # the marker: written last

    def restore(self, layer: str, module: torch.nn.Module) -> dict[str, Any]:
        """Load a finished layer's tensors into `module` (offloaded or not); its measurements."""
        from compressed_tensors.offload import update_offload_parameter
        from safetensors.torch import load_file

        assert self.folder is not None
        i = self.index(layer)
        for key, value in load_file(str(self.folder / f"{i:04d}.safetensors")).items():
            owner, _, name = key.rpartition(".")
            update_offload_parameter(module.get_submodule(owner) if owner else module, name, value)
        self.restored.add(layer)
        return dict(json.loads((self.folder / f"{i:04d}.json").read_text()))

    def clear(self) -> None:
        if self.folder is not None and ranks.is_writer():
            shutil.rmtree(self.folder, ignore_errors=True)


def _agreed(n: int) -> int:
    """Every rank must skip the same layers: the fewest any rank can load."""
    import torch.distributed as dist

    if ranks.world_size() == 1:
        return n
    t = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


@contextlib.contextmanager
def restoring(model: Any, store: LayerStore) -> Iterator[None]:
    """Inside: the sequential pipeline's subgraph of a restorable layer loads the stored
    layer on its first call and runs with llm-compressor's hooks off (no statistics)."""
    if not store.restorable:
        yield
        return
    from llmcompressor.modifiers.utils.hooks import HooksMixin

    names = {id(m): n for n, m in model.named_modules()}
    which: dict[int, str | None] = {}

    def subgraph_forward(subgraph: Any, model: Any, run: Any) -> Any:
        if id(subgraph) not in which:
            direct = (names.get(id(m)) for m in subgraph.submodules(model, recurse=False))
            which[id(subgraph)] = next((n for n in direct if n and store.is_restorable(n)), None)
        layer = which[id(subgraph)]
        if layer is None:
            return run()
        if layer not in store.restored:
            store.measured[layer] = store.restore(layer, model.get_submodule(layer))
        with HooksMixin.disable_hooks():
            return run()

    with subgraph_forward_wrapped(subgraph_forward):
        yield
