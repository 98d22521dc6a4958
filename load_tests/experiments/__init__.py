"""Experiments: the one-off scripts behind the data folders of docs/results/, one sub-folder
each, named like the folder whose data it made (`loadtest_bursty_ab/` -> `loadtest-bursty-ab/`).

What flows through: a run's settings (rates, seeds, a fixed SLO, scheduler overrides) in;
JSON and per-request records out, written where the command says, then committed under
docs/results/ with a README that gives the command. They use the harness and the product as
any client does; nothing in the product or the harness imports them
(tests/test_import_graph.py), so they may be kept as they ran.
"""
