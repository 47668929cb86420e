"""Evaluation throughput and cached-vs-exact agreement, on CPU or CUDA.

    .venv/bin/python bench/eval_bench.py --reference REF_DIR --candidate CAND_DIR \
        [--ids ids.pt|tokens.safetensors | --text FILE] [--sequences 32] [--seq-len 512] [--batch-size 4] \
        [--topk 128 256] [--device cuda] [--json out.json]

Measures, on the same held-out batches (after one warm-up batch):
  forward        bare forward passes of reference + candidate (logits only)
  exact          forward + full-vocabulary float64 KL in lockstep (kl_stats.exact_token_stats)
  cached-topK    reference top-k extraction + candidate forward + top-k+tail KL
and reports tokens/s, the overhead of each KL mode over the bare forwards, and the
relative gap of the cached mean KL to the exact one (it is a lower bound). Held-out ids:
a saved LongTensor (--ids), or --text tokenized with the reference's tokenizer (default:
gensim's lee.cor news, which is outside the default calibration's... see eval/README.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.evaluate import kl_stats  # noqa: E402
from pipeline.evaluate.scoring import forward_logits, kv_quantization  # noqa: E402
from pipeline.model.loading import load_model  # noqa: E402


def _ids(args, ref_dir: Path) -> torch.Tensor:
    n = args.sequences * args.seq_len
    if args.ids and Path(args.ids).suffix == ".safetensors":
        # a qship token-set entry (cache/tokens/<key>/tokens.safetensors): its held-out set
        from safetensors.torch import load_file

        flat = load_file(str(args.ids))["heldout_ids"].long().flatten()
    elif args.ids:
        flat = torch.load(args.ids).long().flatten()
    else:
        from transformers import AutoTokenizer

        path = args.text or (
            Path(importlib.util.find_spec("gensim").origin).parent
            / "test"
            / "test_data"
            / "lee.cor"
        )
        text = Path(path).read_bytes().decode("latin-1")
        flat = torch.tensor(
            AutoTokenizer.from_pretrained(str(ref_dir))(text, add_special_tokens=False)["input_ids"]
        )
    if flat.numel() < n:
        reps = -(-n // flat.numel())
        print(f"note: only {flat.numel()} tokens; repeating them {reps}x", file=sys.stderr)
        flat = flat.repeat(reps)
    return flat[:n].view(args.sequences, args.seq_len)


def _sync(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reference", type=Path, required=True)
    ap.add_argument("--candidate", type=Path, required=True)
    ap.add_argument("--ids", type=Path)
    ap.add_argument("--text", type=Path)
    ap.add_argument("--sequences", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--topk", type=int, nargs="+", default=[128, 256])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--kl-dtype", choices=["float64", "float32"], default="float64",
        help="dtype of the log-softmax / KL arithmetic (qship evaluate: float64)",
    )  # fmt: skip
    ap.add_argument("--chunk", type=int, default=kl_stats.CHUNK, help="positions per KL chunk")
    ap.add_argument("--fused", action="store_true", help="exact KL via torch.compile'd fused rows")
    ap.add_argument(
        "--repeat", type=int, default=3,
        help="time the bare and exact passes this many times, interleaved; medians reported",
    )  # fmt: skip
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = args.device
    kw = {"dtype": getattr(torch, args.kl_dtype), "chunk": args.chunk}
    exact_fn = kl_stats.exact_token_stats
    if args.fused:  # the fused reduction form, compiled (its first call compiles: warm-up)
        import functools

        exact_fn = functools.partial(kl_stats.exact_token_stats_fused, compile=True)
    ids = _ids(args, args.reference)
    ref = load_model(args.reference, device=dev)
    cand = load_model(args.candidate, device=dev)
    batches = [ids[s : s + args.batch_size] for s in range(0, ids.shape[0], args.batch_size)]
    tokens = ids.shape[0] * (ids.shape[1] - 1)
    # warm-up (kernels, decompression on first forward, allocator)
    forward_logits(ref, batches[0])
    forward_logits(cand, batches[0])
    if args.fused:  # compile outside the timed region
        rl, nxt = forward_logits(ref, batches[0])
        exact_fn(rl, forward_logits(cand, batches[0])[0], nxt, **kw)
        del rl
    _sync(dev)

    def timed(fn) -> float:
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        return time.perf_counter() - t0

    def bare():
        for b in batches:
            forward_logits(ref, b)
            forward_logits(cand, b)

    acc_exact = kl_stats.Accumulator()

    def exact():
        for b in batches:
            rl, nxt = forward_logits(ref, b)
            cl, _ = forward_logits(cand, b)
            acc_exact.add(exact_fn(rl, cl, nxt, **kw))  # the last repeat's accumulator

    res: dict = {
        "device": dev,
        "device_name": torch.cuda.get_device_name() if dev.startswith("cuda") else "cpu",
        "threads": torch.get_num_threads(),
        "reference": str(args.reference),
        "candidate": str(args.candidate),
        "sequences": args.sequences,
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "kl_dtype": args.kl_dtype,
        "fused": args.fused,
        "chunk": args.chunk,
        "tokens": tokens,
        "vocab": ref.config.get_text_config().vocab_size,
    }
    bares, exacts = [], []
    for _ in range(args.repeat):  # interleaved, so drifting clocks hit both alike
        bares.append(timed(bare))
        acc_exact = kl_stats.Accumulator()
        exacts.append(timed(exact))
    t_bare, t_exact = statistics.median(bares), statistics.median(exacts)
    e = acc_exact.summary()
    res["forward"] = {"s": t_bare, "tokens_per_s": tokens / t_bare, "runs_s": bares}
    res["exact"] = {
        "s": t_exact,
        "tokens_per_s": tokens / t_exact,
        "overhead_vs_forward": t_exact / t_bare - 1,
        "runs_s": exacts,
        "kl_mean": e["kl"]["mean"],
        "kl_p99": e["kl"]["p99"],
        "top1": e["top1_agreement"],
        "ppl_ratio": e["ppl_ratio"],
    }
    for k in args.topk:
        acc = kl_stats.Accumulator()
        stored: list[dict] = []

        def ref_pass(k=k, stored=stored):
            for b in batches:
                rl, nxt = forward_logits(ref, b)
                stored.append(kl_stats.reference_topk(rl, nxt, k, **kw))

        def cand_pass(acc=acc, stored=stored):
            for b, part in zip(batches, stored, strict=True):
                cl, nxt = forward_logits(cand, b)
                acc.add(kl_stats.kl_topk_tail(part, cl, nxt, **kw))

        t_ref, t_cand = timed(ref_pass), timed(cand_pass)
        c = acc.summary()
        res[f"cached_top{k}"] = {
            "reference_pass_s": t_ref,
            "candidate_pass_s": t_cand,
            "tokens_per_s": tokens / (t_ref + t_cand),
            "overhead_vs_forward": (t_ref + t_cand) / t_bare - 1,
            "kl_mean": c["kl"]["mean"],
            "rel_gap_to_exact": (e["kl"]["mean"] - c["kl"]["mean"]) / e["kl"]["mean"]
            if e["kl"]["mean"] > 0
            else 0.0,
            "kl_p99": c["kl"]["p99"],
            "bytes_per_token": k * 8 + 8 + 8 + 4,
        }
    # KV on vs off (weights-only figure), exact
    acc_off = kl_stats.Accumulator()

    def exact_kv_off():
        with kv_quantization(cand, False):
            for b in batches:
                rl, nxt = forward_logits(ref, b)
                cl, _ = forward_logits(cand, b)
                acc_off.add(exact_fn(rl, cl, nxt, **kw))

    timed(exact_kv_off)
    off = acc_off.summary()
    res["exact_kv_off"] = {
        "kl_mean": off["kl"]["mean"],
        "kl_p99": off["kl"]["p99"],
        "top1": off["top1_agreement"],
    }
    text = json.dumps(res, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
