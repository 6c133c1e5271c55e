"""``dpboard sim``: deterministic trace-driven simulation of dispatch methods.

trace.py holds a trace and draws the synthetic scenarios; tracefile.py reads real traces (Azure,
Mooncake, BurstGPT) and shapes them for a run; workload.py says what ``--load`` means; model.py is
the rank model (steps, chunked prefill, KV pool, queues); prefix_cache.py the prefix caches (a
rank's own, and what routers know of them); profile.py reads rank profiles (profiles/*.profile);
policy.py wraps each dispatch method (dpboard's real ``Dispatcher``) and defines what a policy is
told; peers.py holds the peers' routers (vLLM, SGLang's gateway, Dynamo); methods.py turns a
method spec into its policy; simulation.py is the
event loop; report.py summarises, tabulates and plots; cli.py is the command.
"""
