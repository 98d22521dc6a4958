"""The Ray Serve application: `deploy.serve_app.app:build_app` is the import path of
`serve run|deploy`.

app_args.py types the builder's arguments; app.py has two deployments, TokenmuxCluster
(owns the topology) and TokenmuxIngress (the OpenAI edge over cluster_engine.py's
ClusterEngineClient: router.pick -> worker.generate stream). serve_config*.yaml and
kuberay/ are the configs that deploy it.
"""
