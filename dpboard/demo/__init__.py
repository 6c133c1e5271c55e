"""``dpboard demo``: a simulated DP cluster on this machine, with the live board.

run.py orchestrates it (board, processes, the live view, the summary); scheduler.py is one
synthetic scheduler process publishing through ``LoadPublisher``; load.py generates the requests.
"""
