"""The evaluate stage: a candidate against its reference -> an EvalReport.

engine.py           evaluate(): cached (top-k + tail) or exact (lockstep) mode
scoring.py          forward passes, the FP8 KV switch, scoring against a cached reference
kl_stats.py         per-token KL, top-1, NLL, Δp and their summary statistics
reference_cache.py  reference log-probs computed once per model and held-out set
benchmarks.py       lm-eval tasks for both models, and the drop
markdown.py         eval.json / eval.md
"""

from .engine import evaluate, model_ref
from .markdown import render_markdown, write_outputs
from .reference_cache import DEFAULT_TOPK

__all__ = ["DEFAULT_TOPK", "evaluate", "model_ref", "render_markdown", "write_outputs"]
