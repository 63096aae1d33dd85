"""Exchanging the addresses of the ranks' TensorFlow servers at start-up.

TensorFlow's collective runtime must know every process's server address
before it starts. Launchers such as mpirun or srun do not hand them out, so
the processes exchange them once through a small TCP rendezvous:

1. rank 0 listens on the coordinator's port (on every interface) and
   registers its own address directly;
2. every other rank connects to the coordinator (retrying until rank 0
   listens) and sends one JSON line ``{"rank": r, "size": n, "address":
   "host:port"}``;
3. once all ``n`` ranks are in, rank 0 answers each with one JSON line
   ``{"addresses": [...]}`` (rank order) and closes the port. An error (a
   duplicate rank or address, a different number of processes, a timeout) is
   answered as ``{"error": "...", "kind": "value" | "timeout"}`` to every
   connected rank, so that all of them fail with rank 0's message.

Every wait is bounded by the caller's timeout. Ranks other than 0 wait a few
seconds longer for rank 0's answer than for the connection, so that rank 0's
report of which ranks are missing reaches them.

This module does not import TensorFlow.
"""

from __future__ import annotations

import json
import os
import selectors
import socket
import time
from typing import Dict, List, Mapping, Optional, Tuple

from smp_tf.distributed.cluster import ClusterInfo, parse_address

__all__ = ["exchange_addresses", "my_host"]

# Extra time a rank waits for rank 0's answer beyond its own timeout, so that
# rank 0's timeout error (which names the missing ranks) arrives first.
_REPLY_GRACE_S = 5.0
# Connecting is retried with a growing pause while rank 0 is not listening.
_RETRY_FIRST_S = 0.05
_RETRY_MAX_S = 1.0
# A registration is a few dozen bytes and the answer ~30 bytes per rank; a
# peer sending more than this is not one of ours.
_MAX_LINE_BYTES = 1 << 16
_MAX_REPLY_BYTES = 1 << 24

# What to check when ranks are missing, by `ClusterInfo.source`.
_MISSING_HINTS = {
    "slurm": " (under SLURM, start every process with srun: a batch script by itself is only task 0)",
    "mpirun": " (under mpirun, MASTER_ADDR must be the host where rank 0 runs)",
    "pmi": " (under mpiexec, MASTER_ADDR must be the host where rank 0 runs)",
}


def my_host(env: Mapping[str, str] = os.environ) -> str:
    """Returns a name or address of this host that the other hosts can reach.

    Args:
        env: the environment; ``SMP_TF_HOST`` there, if set, is returned as
            is (set it when the host has several networks, or to
            ``127.0.0.1`` for a job on one machine).

    Returns:
        ``SMP_TF_HOST``; else the fully qualified domain name or the host
        name, whichever resolves to an address other than loopback; else the
        IP address of the interface that routes outside; else the host name.
    """
    override = (env.get("SMP_TF_HOST") or "").strip()
    if override:
        return override
    for name in (socket.getfqdn(), socket.gethostname()):
        if name and _resolves_outside_loopback(name):
            return name
    return _outbound_ip() or socket.gethostname()


def _resolves_outside_loopback(name: str) -> bool:
    try:
        infos = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    return any(not (str(info[4][0]).startswith("127.") or info[4][0] == "::1") for info in infos)


def _outbound_ip() -> Optional[str]:
    # Connecting a UDP socket sends nothing; it only asks the kernel which
    # local address routes to the (documentation-range) destination.
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))
            ip = s.getsockname()[0]
    except OSError:
        return None
    return None if ip.startswith("127.") or ip == "0.0.0.0" else ip


def exchange_addresses(info: ClusterInfo, my_address: str, timeout: float) -> Tuple[str, ...]:
    """Tells every rank the server address of every other rank.

    Every process of the job calls this once, at start-up, with its own
    address; each gets the same list back.

    Args:
        info: this process's `ClusterInfo`. When it already lists the
            addresses (or the job is one process), nothing is exchanged.
        my_address: ``host:port`` of this process's TensorFlow server,
            reachable from the other hosts (see `my_host`).
        timeout: seconds to wait for all ranks; rank 0 waits this long for
            the others to register, the others this long to reach rank 0.

    Returns:
        The ``host:port`` of every rank, in rank order.

    Raises:
        ValueError: `my_address` is not ``host:port``; two ranks claim the
            same rank or address; ranks disagree on the number of processes;
            `timeout` is not positive.
        TimeoutError: not every rank registered in time (the message names
            the missing ranks), or rank 0 could not be reached.
        OSError: rank 0 cannot listen on the coordinator's port (it is in
            use).
    """
    if info.addresses is not None:
        return info.addresses
    parse_address(my_address)
    if not info.is_distributed:
        return (my_address,)
    if not timeout > 0:
        raise ValueError(f"The rendezvous timeout must be positive. Received: timeout={timeout!r}")
    assert info.coordinator is not None  # ClusterInfo guarantees it for size > 1
    if info.rank == 0:
        return _serve(info, my_address, timeout)
    return _register(info, my_address, timeout)


# ---------------------------------------------------------------------------
# Rank 0.


class _Registry:
    """Rank 0's view of who has registered, over which connection."""

    def __init__(self, info: ClusterInfo, my_address: str) -> None:
        self.info = info
        self.addresses: Dict[int, str] = {0: my_address}
        self.conn_of: Dict[int, socket.socket] = {}

    def add(self, conn: socket.socket, peer: str, message: Dict[str, object]) -> Optional[socket.socket]:
        """Registers one rank's message.

        Returns:
            The earlier connection of the same rank, when it connected again
            (the caller closes it); else None.

        Raises:
            ValueError: the message conflicts with the registered ranks.
        """
        rank, size, address = message["rank"], message["size"], message["address"]
        assert isinstance(rank, int) and isinstance(size, int) and isinstance(address, str)
        if size != self.info.size:
            raise ValueError(
                f"The processes disagree on their number: rank {rank} (at {peer}) was started "
                f"for {size} processes but rank 0 for {self.info.size}. Start every process "
                "with the same launcher and process count."
            )
        if not 0 <= rank < size:
            raise ValueError(
                f"A process at {peer} says it is rank {rank}, which is not a rank of a job of "
                f"{size} processes."
            )
        if rank in self.addresses:
            same_process = rank in self.conn_of and self.addresses[rank] == address
            if not same_process:
                raise ValueError(
                    f"Two processes say they are rank {rank}: one with address "
                    f"{self.addresses[rank]!r} and one at {peer} with address {address!r}. Every "
                    "process needs its own rank; check the launcher's rank variables."
                )
        for other, other_address in self.addresses.items():
            if other != rank and other_address.lower() == address.lower():
                raise ValueError(
                    f"Ranks {other} and {rank} both give the address {address!r}; every process "
                    "needs its own port."
                )
        # The same rank connecting again (it lost its connection and
        # retried) replaces its earlier connection.
        earlier = self.conn_of.get(rank)
        self.addresses[rank] = address
        self.conn_of[rank] = conn
        return earlier if earlier is not conn else None

    def drop(self, conn: socket.socket) -> None:
        """Forgets the rank registered over `conn` (its process went away)."""
        for rank, c in list(self.conn_of.items()):
            if c is conn:
                del self.conn_of[rank]
                del self.addresses[rank]

    def missing(self) -> List[int]:
        return [r for r in range(self.info.size) if r not in self.addresses]


def _listen(info: ClusterInfo) -> socket.socket:
    host, port = parse_address(info.coordinator or "")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    # SO_REUSEADDR lets rank 0 restart while old connections sit in
    # TIME_WAIT; binding still fails if any process listens on the port.
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(("::" if family == socket.AF_INET6 else "", port))
        listener.listen(min(info.size + 16, socket.SOMAXCONN))
    except OSError as e:
        listener.close()
        raise OSError(
            e.errno,
            f"Rank 0 cannot listen on port {port} of the coordinator {info.coordinator} "
            f"({e.strerror or e}); another process probably holds the port. Choose a free "
            "port for every process with SMP_TF_COORDINATOR_PORT or MASTER_PORT (or "
            "SMP_TF_COORDINATOR=<host>:<port>).",
        ) from e
    listener.setblocking(False)
    return listener


def _parse_registration(line: bytes) -> Optional[Dict[str, object]]:
    try:
        message = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    if (
        not isinstance(message, dict)
        or not all(isinstance(message.get(k), int) and not isinstance(message.get(k), bool) for k in ("rank", "size"))
        or not isinstance(message.get("address"), str)
    ):
        return None
    try:
        parse_address(message["address"])
    except ValueError:
        return None
    return message


def _send_line(conn: socket.socket, payload: Dict[str, object]) -> None:
    # Best effort: a rank that went away will time out on its own.
    try:
        conn.setblocking(True)
        conn.settimeout(_REPLY_GRACE_S)
        conn.sendall(json.dumps(payload).encode("utf-8") + b"\n")
    except OSError:
        pass


def _serve(info: ClusterInfo, my_address: str, timeout: float) -> Tuple[str, ...]:
    listener = _listen(info)
    registry = _Registry(info, my_address)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    buffers: Dict[socket.socket, bytearray] = {}
    peers: Dict[socket.socket, str] = {}
    deadline = time.monotonic() + timeout

    def close(conn: socket.socket) -> None:
        registry.drop(conn)
        selector.unregister(conn)
        buffers.pop(conn, None)
        peers.pop(conn, None)
        conn.close()

    def fail(error: Exception, kind: str) -> None:
        for conn in list(buffers):
            _send_line(conn, {"error": str(error), "kind": kind})
        raise error

    try:
        while registry.missing():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                fail(
                    TimeoutError(
                        f"rank 0 waited {timeout:g} s for ranks {registry.missing()} at "
                        f"{info.coordinator}; check that every process started and that the "
                        f"coordinator address is reachable{_MISSING_HINTS.get(info.source, '')}"
                    ),
                    "timeout",
                )
            for key, _ in selector.select(min(remaining, 1.0)):
                if key.fileobj is listener:
                    try:
                        conn, peer = listener.accept()
                    except (BlockingIOError, InterruptedError):
                        continue
                    conn.setblocking(False)
                    selector.register(conn, selectors.EVENT_READ)
                    buffers[conn] = bytearray()
                    peers[conn] = _join_peer(peer)
                    continue
                conn = key.fileobj  # type: ignore[assignment]
                try:
                    chunk = conn.recv(4096)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    chunk = b""
                if not chunk:
                    close(conn)
                    continue
                buffer = buffers[conn]
                buffer.extend(chunk)
                if b"\n" not in buffer:
                    if len(buffer) > _MAX_LINE_BYTES:
                        close(conn)
                    continue
                line = bytes(buffer[: buffer.index(b"\n")])
                del buffer[:]
                message = _parse_registration(line)
                if message is None:
                    # Not one of our processes (a port scanner, a stale
                    # client of another job): tell it and carry on.
                    _send_line(conn, {"error": "not an smp_tf rendezvous registration", "kind": "value"})
                    close(conn)
                    continue
                try:
                    earlier = registry.add(conn, peers[conn], message)
                except ValueError as e:
                    fail(e, "value")
                if earlier is not None:
                    close(earlier)
        result = tuple(registry.addresses[r] for r in range(info.size))
        for conn in list(buffers):
            if conn in registry.conn_of.values():
                _send_line(conn, {"addresses": list(result)})
        return result
    finally:
        for conn in list(buffers):
            conn.close()
        selector.close()
        listener.close()


def _join_peer(peer: Tuple) -> str:
    host, port = peer[0], peer[1]
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"


# ---------------------------------------------------------------------------
# Ranks 1 to size - 1.


def _register(info: ClusterInfo, my_address: str, timeout: float) -> Tuple[str, ...]:
    host, port = parse_address(info.coordinator or "")
    message = json.dumps({"rank": info.rank, "size": info.size, "address": my_address}).encode("utf-8") + b"\n"
    deadline = time.monotonic() + timeout
    pause = _RETRY_FIRST_S
    last_error: Optional[BaseException] = None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(
                f"rank {info.rank} could not reach the coordinator (rank 0) at {info.coordinator} "
                f"within {timeout:g} s (last error: {last_error}); check that rank 0 started, "
                "that the coordinator names its host, and that the port is reachable from "
                "this host"
            )
        try:
            conn = socket.create_connection((host, port), timeout=min(remaining, 5.0))
        except OSError as e:
            # Refused or unreachable: rank 0 is not listening yet.
            last_error = e
            time.sleep(min(pause, max(remaining, 0.0)))
            pause = min(pause * 2, _RETRY_MAX_S)
            continue
        try:
            conn.settimeout(max(remaining, 0.1))
            conn.sendall(message)
            reply = _read_line(conn, deadline + _REPLY_GRACE_S)
        except socket.timeout:
            raise TimeoutError(
                f"rank {info.rank} registered with the coordinator at {info.coordinator} but "
                f"not every rank did within {timeout:g} s; rank 0's error names the missing "
                "ranks"
            ) from None
        except OSError as e:
            reply, last_error = None, e
        finally:
            conn.close()
        if reply is None:
            # Rank 0 went away before answering (or it is not rank 0):
            # try again until the deadline.
            last_error = last_error or ConnectionError("the coordinator closed the connection")
            time.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))
            pause = min(pause * 2, _RETRY_MAX_S)
            continue
        return _check_reply(info, my_address, reply)


def _read_line(conn: socket.socket, deadline: float) -> Optional[bytes]:
    """Reads one line, or None if the peer closes first; raises socket.timeout."""
    data = bytearray()
    while b"\n" not in data:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise socket.timeout("timed out")
        conn.settimeout(remaining)
        chunk = conn.recv(65536)
        if not chunk:
            return None
        data.extend(chunk)
        if len(data) > _MAX_REPLY_BYTES:
            return None
    return bytes(data[: data.index(b"\n")])


def _check_reply(info: ClusterInfo, my_address: str, line: bytes) -> Tuple[str, ...]:
    try:
        reply = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        reply = None
    if isinstance(reply, dict) and isinstance(reply.get("error"), str):
        error = TimeoutError if reply.get("kind") == "timeout" else ValueError
        raise error(f"{reply['error']} (reported by rank 0 at {info.coordinator})")
    addresses = reply.get("addresses") if isinstance(reply, dict) else None
    if (
        not isinstance(addresses, list)
        or len(addresses) != info.size
        or addresses[info.rank] != my_address
    ):
        raise ValueError(
            f"rank {info.rank} got an unexpected answer from the coordinator at "
            f"{info.coordinator}: {line[:200]!r}. Is another program listening on that port?"
        )
    return tuple(addresses)
