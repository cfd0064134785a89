"""`kvchat plan`: what N users would see on hardware you may not have.

The data flow, one file per step: command.py (flags) -> planner.py (a PlanConfig: the model's
geometry, hardware.py's row, the pool) -> workload.py (the users, drawn or read as a trace)
-> simulator.py (a vLLM-v1-like scheduler over block_pool.py, moving request.py's requests)
with step_time.py timing each step -> metrics.py (the figures vllm bench serve reports) ->
report.py and plot.py (text, JSON, charts). calibration.py fits step_time's constants to
measured runs; scenario.py is the texts' question with its remedies.
"""
