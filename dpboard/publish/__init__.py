"""Kernel to board: what a scheduler embeds to publish its rank's load every step.

``LoadPublisher`` (publisher.py) computes the loads from the scheduler's tables with a
``dpboard.loads`` backend and publishes them through the rank's ``BoardWriter``; with a CUDA backend
and ``gpu_direct=True`` the kernel writes the slot itself (gpu_direct.py).
"""

from dpboard.publish.publisher import LoadPublisher

__all__ = ["LoadPublisher"]
