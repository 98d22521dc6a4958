"""The fleet planner (`tokenmux plan`): how many GPUs a marketplace needs, per policy.

What flows through: a workload (workloads.py, synthetic; traces.py, a real trace CSV) and
a marketplace (marketplace.py: each model a type with step costs fitted from measured
profiles, cost_model.py, on a device, devices.py) go into the fleet simulator
(simulator.py, one sim_worker.py per device), which runs the real placement, routing and
per-worker policies of scheduler/ on a virtual clock; metrics.py scores its per-request
records against the SLO; planner.py searches over GPU counts; plan_cli.py is the command.

Part of the control plane, not the harness: it is a user-facing feature that plans a
fleet with the same policies the live cluster runs. The load tests score their runs with
the same workloads, traces and metrics.
"""
