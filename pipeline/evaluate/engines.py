"""Inference engines for the served check (served.py): each loads an artifact the way a
deployment would and returns its log-probs at requested tokens.

* transformers -- compressed-tensors' loader (the FP8 KV cache through its hooks) with the
  attention numerics the measurement used: on the CPU in CI, it must reproduce the
  measured log-probs to float noise, so a corrupted artifact stands out.
* vllm -- `vllm.LLM` on the artifact folder exactly as a server would load it (its
  quantization config, the KV cache dtype asked for; compiled unless `eager`), prompt
  log-probs of the engine's top `served_topk` tokens per position; in a child process of
  vLLM's own environment (vllm_child.py). Its KV cache is sized for the check's own rows
  (kv_cache_bytes), not profiled from free memory: vLLM then skips the profiler that aborts
  when another process on the GPU frees memory during its start, and takes what the check
  needs instead of half the GPU, so a check can run beside other GPU jobs.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .. import log
from ..errors import UsageError

VLLM_PIN = "vllm==0.26.0"


def unavailable(name: str) -> str | None:
    """Why `name` cannot serve here (None: it can)."""
    if name == "vllm":
        import importlib.util

        if not torch.cuda.is_available():
            return "vLLM needs a CUDA GPU"
        if not os.environ.get("QSHIP_VLLM_PYTHON") and importlib.util.find_spec("vllm") is None:
            return f"vLLM is not installed (QSHIP_VLLM_PYTHON unset; {VLLM_PIN})"
    return None


def make(name: str, model_dir: Path, **opts: Any) -> Any:
    """The engine `name` on `model_dir`, serving the layers its recipe keeps 16-bit
    (kv_cache.skip_layers) with a 16-bit KV cache, as deployed."""
    from ..records.checkpoint import kv_skip_layers

    opts.setdefault("kv_skip_layers", kv_skip_layers(Path(model_dir)))
    if name == "transformers":
        return TransformersEngine(model_dir, **opts)
    if name == "vllm":
        return VllmEngine(model_dir, **opts)
    raise UsageError(f"unknown serving engine {name!r}", path="--serve",
                     hint="use vllm or transformers")  # fmt: skip


class TransformersEngine:
    name = "transformers"

    def __init__(self, model_dir: Path, *, kv_cache_dtype: str = "auto", device: str | None = None,
                 attention: str = "kv-only", max_len: int = 0, batch_size: int = 4,
                 kv_skip_layers: tuple[int, ...] = ()) -> None:  # fmt: skip
        from ..model.devices import default_device
        from ..model.loading import load_model
        from .scoring import kv_modules, skip_kv_layers

        self.device = device or default_device()
        self.model = load_model(Path(model_dir), device=self.device, dtype=None)
        skip_kv_layers(self.model, kv_skip_layers)
        self.hooked = kv_modules(self.model)
        self.kv_on = kv_cache_dtype != "bfloat16"
        self.attention = attention if self.kv_on else "kv-only"
        self.batch_size = batch_size
        self.facts = {"kv_hooked_attention_modules": str(len(self.hooked)),
                      "attention": self.attention, "device": self.device}  # fmt: skip

    @contextlib.contextmanager
    def _as_served(self) -> Iterator[None]:
        """The KV-cache rounding on or off, and the attention numerics the measurement used."""
        from .numerics import served_attention
        from .scoring import kv_quantization

        with (
            kv_quantization(self.model, self.kv_on),
            served_attention(self.model, self.attention, self.hooked),
        ):
            yield

    @torch.inference_mode()
    def logprobs_at(
        self, ids: torch.Tensor, want: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        from .scoring import forward_logits

        per_seq = ids.shape[1] - 1
        out, top1 = [], []
        with self._as_served():
            for s in range(0, ids.shape[0], self.batch_size):
                logits, _ = forward_logits(self.model, ids[s : s + self.batch_size])
                rows = want[s * per_seq : s * per_seq + logits.shape[0]].to(logits.device)
                lp = torch.log_softmax(logits.double(), -1)
                out.append(lp.gather(-1, rows).cpu())
                top1.append(lp.argmax(-1).cpu())
                del logits, lp
        return torch.cat(out), torch.cat(top1), 0

    def tail_top1_sets(self, sets: list[tuple[torch.Tensor, int]]) -> list[torch.Tensor]:
        return [self.tail_top1(ids, n) for ids, n in sets]

    @torch.inference_mode()
    def tail_top1(self, ids: torch.Tensor, n: int) -> torch.Tensor:
        """[N, n]: the top-1 token predicted at each of each row's last n positions, one
        row at a time, logits only where they are read (a 32k-token row's full logits over
        Gemma's 262k vocabulary would be 34 GB)."""
        dev = next(self.model.parameters()).device
        keep = torch.arange(ids.shape[1] - n - 1, ids.shape[1] - 1, device=dev)
        out = []
        with self._as_served():
            for row in ids:
                logits = self.model(input_ids=row[None].to(dev), use_cache=False,
                                    logits_to_keep=keep).logits  # fmt: skip
                out.append(logits[0].argmax(-1).cpu())
        return torch.stack(out)


# vLLM logs each kernel it chooses for a quantization scheme once, however many layers it
# serves: "Using MacheteLinearKernel for CompressedTensorsWNA16", "Selected
# CutlassFP8ScaledMMLinearKernel for ..."; a scheme whose layers take two kernels (SmolLM2's
# W4A16 on the H100: Machete for 30 Linears, Marlin for 90) logs two lines
_KERNEL_LINE = re.compile(r"(?:Using|Selected|using) ([A-Za-z0-9_]+) (?:for|as) ([A-Za-z0-9_]+)")
# a warning line of vLLM's log ("... WARNING 12-07 10:01:02 [file.py:12] message") about speed
_WARNING_LINE = re.compile(r"WARNING[^\[\n]*\[[^\]\n]*\] ?([^\n]*)")
_PERFORMANCE = re.compile(r"perform|degrad|slow|fall(?:ing)? ?back", re.IGNORECASE)


def kernels_in_log(text: str) -> dict[str, list[str]]:
    """{scheme: every kernel vLLM logged for it, in log order} (what ran, so a silent
    fallback shows; counts per Linear: `kernel_counts` of the served check's module walk)."""
    out: dict[str, list[str]] = {}
    for kernel, scheme in _KERNEL_LINE.findall(text):
        if "Kernel" in kernel or "Linear" in kernel or scheme.startswith("CompressedTensors"):
            seen = out.setdefault(scheme, [])
            if kernel not in seen:
                seen.append(kernel)
    return out


def performance_warnings(text: str) -> list[str]:
    """vLLM's warnings about speed ("Marlin requires thread-tile padding ... performance may
    be degraded"), each once, in log order."""
    out: list[str] = []
    for msg in _WARNING_LINE.findall(text):
        msg = msg.strip()
        if _PERFORMANCE.search(msg) and msg not in out:
            out.append(msg)
    return out


KV_FLOOR_BYTES = 256 << 20  # vLLM's blocks for a short check; a few MB would do
KV_MAX_SEQS = 64  # sequences held at once; vLLM schedules the rest in turn


def kv_cache_bytes(config: dict, kv_cache_dtype: str, seqs: int, seq_len: int) -> int:
    """KV-cache memory for `seqs` sequences of `seq_len` tokens (at most KV_MAX_SEQS at
    once), as if every layer attended to the full context (an upper bound where layers
    use a sliding window), plus 10 %."""
    from ..model.checkpoint import text_config

    c = text_config(config)
    heads = int(c["num_attention_heads"])
    head_dim = int(c.get("head_dim") or int(c["hidden_size"]) // heads)
    width = 1 if kv_cache_dtype.startswith("fp8") else 2
    per_token = (
        2
        * int(c["num_hidden_layers"])
        * int(c.get("num_key_value_heads") or heads)
        * head_dim
        * width
    )
    need = per_token * min(seqs, KV_MAX_SEQS) * seq_len
    return max(KV_FLOOR_BYTES, int(need * 1.1))


class VllmEngine:
    """vLLM in a child process (vllm_child.py) of $QSHIP_VLLM_PYTHON -- its own environment,
    since vLLM pins other versions than qship (requirements/serve.lock) -- or of this Python
    when vLLM is importable here."""

    def __init__(self, model_dir: Path, *, kv_cache_dtype: str = "auto", device: str | None = None,
                 attention: str = "", max_len: int = 0, served_topk: int = 256,
                 eager: bool = False, kv_skip_layers: tuple[int, ...] = ()) -> None:  # fmt: skip
        reason = unavailable("vllm")
        if reason is not None:
            raise UsageError(
                f"the served check with vLLM cannot run here: {reason}",
                path="--serve vllm",
                hint=f"pip install 'qship[serve]' ({VLLM_PIN}, CUDA only) into its own "
                "environment (`make serve-env`) and set QSHIP_VLLM_PYTHON to its python; "
                "on a GPU host without internet see the README, 'GPU host without internet'",
            )
        self.config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
        self.args = {"model": str(Path(model_dir).resolve()), "kv_cache_dtype": kv_cache_dtype,
                     "served_topk": served_topk, "eager": eager,
                     # vLLM's --kv-cache-dtype-skip-layers: these layers' KV cache 16-bit
                     "kv_cache_dtype_skip_layers": [str(i) for i in kv_skip_layers]}  # fmt: skip
        self.name = "vllm"
        self.facts: dict[str, str] = {"kv_cache_dtype": kv_cache_dtype, "enforce_eager": str(eager)}
        if kv_skip_layers:
            self.facts["kv_cache_dtype_skip_layers"] = ",".join(map(str, kv_skip_layers))

    def logprobs_at(
        self, ids: torch.Tensor, want: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        out, missing = self._child({"ids": ids, "want": want}, self.args)
        return out["vals"], out["top1"], missing

    def tail_top1_sets(self, sets: list[tuple[torch.Tensor, int]]) -> list[torch.Tensor]:
        """Per set (ids [N, T], n): [N, n], vLLM's greedy continuation of each row's first
        T - n tokens -- every set in one engine start."""
        args = {**self.args, "generate": [n for _, n in sets]}
        out, _ = self._child({f"ids.{i}": ids[:, :-n] for i, (ids, n) in enumerate(sets)}, args)
        return [out[f"generated.{i}"] for i in range(len(sets))]

    def _child(self, tensors: dict[str, torch.Tensor], args: dict) -> tuple[dict, int]:
        import sys
        import tempfile

        from safetensors.torch import load_file, save_file

        from ..errors import StageError

        with tempfile.TemporaryDirectory(prefix="qship-vllm-") as tmp:
            work = Path(tmp)
            # the rows vLLM holds at once: the longest prompt and what it generates
            sets = [v for k, v in tensors.items() if k.startswith("ids")]
            seq_len = max(int(x.shape[1]) for x in sets) + max([1, *(args.get("generate") or [])])
            args = {**args, "kv_cache_memory_bytes": kv_cache_bytes(
                # 16-bit layers beside FP8 ones: sized as if all were 16-bit
                self.config, "auto" if args["kv_cache_dtype_skip_layers"] else str(args["kv_cache_dtype"]),
                max(int(x.shape[0]) for x in sets),
                seq_len)}  # fmt: skip
            (work / "args.json").write_text(json.dumps(args))
            save_file({k: v.int().contiguous() for k, v in tensors.items()},
                      str(work / "in.safetensors"))  # fmt: skip
            python = os.environ.get("QSHIP_VLLM_PYTHON") or sys.executable
            child = Path(__file__).with_name("vllm_child.py")
            rc, output = log.run_child([python, str(child), str(work)], label="vLLM served check")
            if rc != 0 or not (work / "out.safetensors").is_file():
                raise StageError(
                    f"vLLM failed to serve the artifact (exit {rc}): " + output[-1500:],
                    path=str(self.args["model"]),
                    hint="see vLLM's message above; the artifact's integrity was checked first",
                )
            facts = json.loads((work / "facts.json").read_text())
            out = load_file(str(work / "out.safetensors"))
        logged = kernels_in_log(output)
        if logged:
            facts["kernels_logged"] = logged
        warned = performance_warnings(output)
        if warned:
            facts["performance_warnings"] = warned
        self.name = facts.pop("engine", "vllm")
        missing = int(facts.pop("missing", 0))
        self.facts.update({k: v if isinstance(v, str) else json.dumps(v, sort_keys=True)
                           for k, v in facts.items()})  # fmt: skip
        return out, missing
