"""Two "nodes" on one machine: node1's schedulers publish into node1's board, a relay forwards it,
and node0's collector writes it into node0's board, where any reader sees the whole cluster.

    python examples/relay_two_nodes.py [--ranks-per-node 4] [--steps 20]

On real machines the same pieces run as `dpboard collect` on node0 and `dpboard relay` on node1
(docs/MULTINODE.md). Both boards live in this machine's /dev/shm, so they need different names here.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

from dpboard import Board, LoadSnapshot
from dpboard.multinode.collector import Collector
from dpboard.multinode.relay import Relay
from dpboard.options import count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()),
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--ranks-per-node", type=count(1, 1024), default=4, help="DP ranks on each node")
    parser.add_argument("--steps", type=count(1, 100_000), default=20, help="publishes of each node1 rank, 10 ms apart")
    args = parser.parse_args(argv)
    ranks_per_node = args.ranks_per_node
    tag = os.getpid()
    n_slots = 2 * ranks_per_node  # every board has the cluster's shape; node1 owns the upper half
    with Board.create(f"example-node0-{tag}", n_slots=n_slots, node_id=0) as node0, \
            Board.create(f"example-node1-{tag}", n_slots=n_slots, node_id=1) as node1:
        stop = threading.Event()
        with Collector(node0, "tcp://127.0.0.1:*") as collector, \
                Relay(node1, collector.endpoint, node_id=1, remote_board=node0.name) as relay:
            threads = [threading.Thread(target=collector.serve, args=(stop,), kwargs={"poll_ms": 10}),
                       threading.Thread(target=relay.run, args=(stop,))]
            for t in threads:
                t.start()
            try:
                # node0's own schedulers write node0's board directly...
                for rank in range(ranks_per_node):
                    node0.writer(rank).publish(LoadSnapshot(dp_rank=rank, num_running_reqs=rank,
                                                            max_total_num_tokens=1000))
                # ...node1's write node1's board; the relay carries them over.
                writers = {r: node1.writer(r) for r in range(ranks_per_node, n_slots)}
                for step in range(args.steps):
                    for rank, w in writers.items():
                        w.publish(LoadSnapshot(dp_rank=rank, num_running_reqs=rank, num_waiting_reqs=step,
                                               num_used_tokens=50 * step, max_total_num_tokens=1000))
                    time.sleep(0.01)
                time.sleep(0.1)
            finally:
                stop.set()
                for t in threads:
                    t.join(5)
            print(f"relay: {relay.stats()}")
            # A frame that cannot be queued at once (the TCP connection still coming up, or node0 not
            # keeping up) is dropped, not waited for; its slots stay "changed" and the next tick
            # carries their newest snapshots, so nothing is lost but a tick of delay.
            print("  (frames_dropped: ticks whose frame could not be queued at once, usually before the "
                  "connection is up; those slots went in the next tick)")
            print(f"collector: {collector.stats()}")
        print(f"node0's board {node0.name!r}:")
        for snap in node0.reader().read_all():
            if snap is not None:
                print(f"  rank {snap.dp_rank}: node {snap.node_id}, running {snap.num_running_reqs}, "
                      f"waiting {snap.num_waiting_reqs}, usage {snap.token_usage:.0%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
