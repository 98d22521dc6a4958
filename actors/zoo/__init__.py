"""The offline model zoo: seeded Hugging Face checkpoints (zoo.py), some trained on the
shipped corpus (zoo_training.py, zoo_corpus.txt), built on first use.

A product package, not harness: the Serve app serves `zoo:NAME` models, the demo and the
README's quick start run on them, and benchmarks and tests load them. It lives in actors/,
the lowest layer whose imports it satisfies: it needs torch, transformers and tokenizers
(so not scheduler/, which is stdlib only) and nothing of the control plane or the edges.
"""
