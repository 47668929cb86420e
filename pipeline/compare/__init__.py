"""Comparing recipes, and finding where bits matter.

compare.py      `qship compare`: in process, --matrix for CI, --collect of CI results
rows.py         report rows from eval.json records
report.py       selection (best, Pareto front) and md / csv / json
plots.py        the Pareto and KL-distribution figures
html.py         the self-contained HTML page
output.py       every report file
sensitivity.py  `qship sensitivity`: KL per module when it alone is rounded
"""
