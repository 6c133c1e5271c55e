"""``dpboard sim``: deterministic trace-driven simulation of dispatch methods.

trace.py makes or reads the request traces; model.py is the rank model (steps, KV, queues);
policy.py wraps each dispatch method (dpboard's real ``Dispatcher`` and the peers' policies);
simulation.py is the event loop; report.py summarises, tabulates and plots; cli.py is the command.
"""
