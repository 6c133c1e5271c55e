"""Two "nodes" on one machine: node1's schedulers publish into node1's board, a relay forwards it,
and node0's collector writes it into node0's board, where any reader sees the whole cluster.

    python examples/relay_two_nodes.py

On real machines the same pieces run as `dpboard collect` on node0 and `dpboard relay` on node1
(docs/MULTINODE.md). Both boards live in this machine's /dev/shm, so they need different names here.
"""

from __future__ import annotations

import os
import threading
import time

from dpboard import Board, LoadSnapshot
from dpboard.multinode.collector import Collector
from dpboard.multinode.relay import Relay

RANKS_PER_NODE = 4


def main() -> None:
    tag = os.getpid()
    n_slots = 2 * RANKS_PER_NODE  # every board has the cluster's shape; node1 owns ranks 4..7
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
                for rank in range(RANKS_PER_NODE):
                    node0.writer(rank).publish(LoadSnapshot(dp_rank=rank, num_running_reqs=rank,
                                                            max_total_num_tokens=1000))
                # ...node1's write node1's board; the relay carries them over.
                writers = {r: node1.writer(r) for r in range(RANKS_PER_NODE, n_slots)}
                for step in range(20):
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
            print(f"collector: {collector.stats()}")
        print(f"node0's board {node0.name!r}:")
        for snap in node0.reader().read_all():
            if snap is not None:
                print(f"  rank {snap.dp_rank}: node {snap.node_id}, running {snap.num_running_reqs}, "
                      f"waiting {snap.num_waiting_reqs}, usage {snap.token_usage:.0%}")


if __name__ == "__main__":
    main()
