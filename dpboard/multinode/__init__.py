"""The side path into node0's board: other nodes' boards relayed over ZMQ.

wire.py is the relay frame (pack, unpack, validate); relay.py forwards a node's changed slots
(``dpboard relay``); collector.py is node0's single PULL owner that writes them into its board
(``dpboard collect``, or embedded in the controller); owners.py says who may speak for a node and
hold a rank; peers.py bounds a bound socket's connections; curve.py holds the CURVE keys of both ends.
"""
