"""An emulated cluster on this one machine: nodes as network namespaces, links shaped with ``tc``.

    fourfold lab run --nodes 2 --gpus-per-node 2 --link 1gbit -- fourfold train --steps 3
    fourfold lab run --nodes 4 --link 1gbit -- fourfold bench allreduce --sizes 16MB

Each node is a Linux network namespace holding one end of a veth pair; the other ends meet on a bridge in a
switch namespace. Every address (:data:`~fourfold.lab.net.SUBNET`) lives only on those veths, inside the lab's
namespaces: nothing is added to the machine's own network, and nothing leaves. Both directions of each node's
link go through a token-bucket filter (``tbf``) at ``--link``; ranks of one node talk over that node's own
loopback, unshaped, as GPUs in one machine do over NVLink. See :mod:`fourfold.lab.net`.
"""

from fourfold.lab.net import SUBNET, Lab, LabUnavailable, parse_rate

__all__ = ["SUBNET", "Lab", "LabUnavailable", "parse_rate"]
