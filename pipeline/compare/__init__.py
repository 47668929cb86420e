"""Comparing recipes, and finding where bits matter.

compare.py      `qship compare`: in process, --matrix for CI, --collect of CI results
rows.py         report rows from eval.json records
report.py       selection (best, Pareto front, the shipped winners) and md / csv / json
plots.py        the Pareto, KL-distribution, task-drop and tune figures
html.py         the self-contained HTML page
output.py       every report file
sensitivity.py  `qship sensitivity`: KL per module when it alone is rounded (at options)
knapsack.py     one option per module, least summed KL within a bit budget
tune.py         `qship tune`: measure (cached), allocate, write, verify
recipe_writer.py the recipes sensitivity and tune write, and their checks
"""
