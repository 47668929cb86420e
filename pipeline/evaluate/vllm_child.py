"""Run by engines.VllmEngine as a script in vLLM's own Python environment (its pins differ
from qship's: requirements/serve.lock), so it imports nothing from qship.

    python vllm_child.py WORKDIR     # reads WORKDIR/args.json + in.safetensors (ids, want)

With args["generate"] = [n0, n1, ...] it generates n_i tokens greedily after each row of
`ids.i` instead (the long-context check: every length in one engine start) and writes
`generated.i` [N_i, n_i].

Loads the artifact with vllm.LLM as a server would (its quantization config, the KV cache
dtype asked for, compiled unless eager), asks for the prompt log-probs of the top
`served_topk` tokens per position and writes WORKDIR/out.safetensors: `vals` [N, m]
(log-prob of each wanted token, the position's k-th value where the engine did not return
it), `top1` [N], and WORKDIR/facts.json (version, kernels, attention, scales, counts).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in-process: inspectable
# vLLM generates one token after the prompt (max_tokens >= 1): a window as long as the
# model's context needs max_model_len = len + 1; that extra token is never read
os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")


def positions(plp):
    """prompt_logprobs (FlatLogprobs or a list of {token: Logprob}) -> per predicted
    position 1..T-1: (token ids, log-probs)."""
    if hasattr(plp, "start_indices"):
        for t in range(1, len(plp)):
            s, e = plp.start_indices[t], plp.end_indices[t]
            yield plp.token_ids[s:e], plp.logprobs[s:e]
        return
    for d in list(plp)[1:]:
        yield list(d.keys()), [v.logprob for v in d.values()]


def inspect(model) -> dict:
    import torch

    kernels: dict[str, int] = {}
    attn: dict = {}  # the first attention layer with a quantized KV cache, else the first
    kv_dtypes: dict[str, int] = {}  # attention layers per KV-cache dtype
    for _, mod in model.named_modules():
        scheme = getattr(mod, "scheme", None)
        if scheme is not None:
            # the scheme's kernel object: WNA16 / W4A8 keep it as `kernel`, FP8 schemes as
            # `fp8_linear` or `w8a8_block_fp8_linear` (the name differs across vLLM versions)
            kern = next((getattr(scheme, a) for a in ("kernel", "fp8_linear",
                         "w8a8_block_fp8_linear", "linear_op") if hasattr(scheme, a)), None)  # fmt: skip
            key = f"{type(scheme).__name__}/{type(kern).__name__}"
            kernels[key] = kernels.get(key, 0) + 1
        if hasattr(mod, "kv_cache_dtype") and hasattr(mod, "impl"):
            kv = str(mod.kv_cache_dtype)  # per layer: --kv-cache-dtype-skip-layers shows here
            kv_dtypes[kv] = kv_dtypes.get(kv, 0) + 1
            if not attn or (attn["kv_cache_dtype"] == "auto" and kv != "auto"):
                attn = {"impl": type(mod.impl).__name__, "kv_cache_dtype": kv}
                for n in ("q", "k", "v"):
                    v = getattr(mod, f"_{n}_scale", None)
                    if isinstance(v, torch.Tensor) and v.numel() == 1:
                        attn[f"{n}_scale"] = float(v.float().item())
    return {"linear_kernels": kernels, "attention": attn, "attention_kv_cache_dtypes": kv_dtypes}


def llm_kwargs(args: dict, max_model_len: int, total_memory: int) -> dict:
    """vllm.LLM's arguments: the KV cache at the size qship computed for the check
    (args["kv_cache_memory_bytes"]: vLLM skips its free-memory profiling), and a
    gpu_memory_utilization that only asks, at start, for room for the weights, that cache
    and 2 GiB of activations and graphs."""
    kv = int(args["kv_cache_memory_bytes"])
    weights = sum(f.stat().st_size for f in Path(args["model"]).glob("*.safetensors"))
    util = min(0.95, max(0.01, (weights + kv + (2 << 30)) / total_memory))
    return {"model": args["model"], "dtype": "auto", "kv_cache_dtype": args["kv_cache_dtype"],
            "max_logprobs": int(args["served_topk"]), "enforce_eager": bool(args["eager"]),
            "seed": 0, "max_model_len": max_model_len, "kv_cache_memory_bytes": kv,
            "gpu_memory_utilization": round(util, 4),
            "kv_cache_dtype_skip_layers": list(args.get("kv_cache_dtype_skip_layers") or [])}  # fmt: skip


def main(work: Path) -> None:
    import torch
    import vllm
    from safetensors.torch import load_file, save_file
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    args = json.loads((work / "args.json").read_text())
    data = load_file(str(work / "in.safetensors"))
    k = int(args["served_topk"])
    gens = [int(n) for n in args.get("generate") or []]  # one per set `ids.i`
    sets = [data[f"ids.{i}"].long() for i in range(len(gens))] or [data["ids"].long()]
    longest = max(int(x.shape[1]) + max(g, 1) for x, g in zip(sets, gens or [0], strict=True))
    t0 = time.perf_counter()
    kwargs = llm_kwargs(args, longest, torch.cuda.get_device_properties(0).total_memory)
    llm = LLM(**kwargs)
    facts: dict = {
        "engine": f"vllm {vllm.__version__}",
        "load_s": round(time.perf_counter() - t0, 2),
        "kv_cache_memory_bytes": kwargs["kv_cache_memory_bytes"],
        "gpu_memory_utilization": kwargs["gpu_memory_utilization"],
    }
    try:
        facts.update(llm.apply_model(inspect)[0])
    except Exception as e:  # noqa: BLE001 - best effort; vllm's log says it too
        facts["inspect_error"] = repr(e)[:300]
    t0 = time.perf_counter()
    if gens:  # the long-context check: greedy continuations of each set, no log-probs
        got = {}
        for i, (ids, gen) in enumerate(zip(sets, gens, strict=True)):
            sp = SamplingParams(max_tokens=gen, min_tokens=gen, temperature=0.0,
                                ignore_eos=True, detokenize=False)  # fmt: skip
            outs = llm.generate([TokensPrompt(prompt_token_ids=r.tolist()) for r in ids], sp,
                                use_tqdm=False)  # fmt: skip
            got[f"generated.{i}"] = torch.tensor(
                [list(o.outputs[0].token_ids)[:gen] for o in outs], dtype=torch.long)  # fmt: skip
        save_file(got, str(work / "out.safetensors"))
    else:
        ids = sets[0]
        sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k, detokenize=False)
        outs = llm.generate([TokensPrompt(prompt_token_ids=r.tolist()) for r in ids], sp,
                            use_tqdm=False)  # fmt: skip
        vals, top1, facts["missing"] = _logprobs(outs, data["want"].long(), ids.shape[1] - 1)
        save_file({"vals": vals, "top1": top1}, str(work / "out.safetensors"))
    facts["score_s"] = round(time.perf_counter() - t0, 2)
    (work / "facts.json").write_text(json.dumps(facts, indent=1, sort_keys=True))


def _logprobs(outs, want, per_seq: int):
    """(vals [N, m], top1 [N], missing) from the prompt log-probs of each output."""
    import torch

    vals = torch.empty(want.shape, dtype=torch.float64)
    top1 = torch.empty(want.shape[0], dtype=torch.long)
    missing = 0
    for s, o in enumerate(outs):
        for t, (tok, lps) in enumerate(positions(o.prompt_logprobs)):
            r = s * per_seq + t
            table = dict(zip(tok, lps, strict=True))
            best = max(table, key=table.__getitem__)
            top1[r] = best
            floor = min(lps)
            row = [table.get(i) for i in want[r].tolist()]
            missing += sum(v is None for v in row)
            vals[r] = torch.tensor([floor if v is None else v for v in row], dtype=torch.float64)
    return vals, top1, missing


if __name__ == "__main__":
    main(Path(sys.argv[1]))
