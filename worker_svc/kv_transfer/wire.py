"""The KV transfer channel's wire format, written once for the server and the puller.

A message is a 4-byte big-endian length and that many bytes of JSON; a reply to a read
over TCP is followed by `nbytes` raw bytes (in the same segment as the reply's end).
Through shared memory the same bytes are written into the puller's file instead. The payload of a
read is the
`[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]` tensor of the asked
layers (in order), K then V, the asked blocks (in the order asked) and KV heads, in the
cache's dtype and this machine's byte order (both ends are x86 or ARM little-endian).
"""

from __future__ import annotations

import json
import socket
import struct
import time
from dataclasses import asdict, dataclass

import torch

PROTOCOL_VERSION = 1
# A read of a million blocks names them in about 8 MB of JSON; a larger header is refused
# before it is read, so a stray client cannot make a server allocate without bound.
MAX_HEADER_BYTES = 16 << 20
SHM_DIR = "/dev/shm"
SHM_PREFIX = "pagemesh-kv-"
_LENGTH = struct.Struct(">I")
# A receive wakes when this many bytes are there (or all it still waits for): woken for
# every segment, a receiver on loopback made several times the calls and took the CPU its
# sender needed.
RECV_LOW_WATER_BYTES = 256 << 10


@dataclass(frozen=True)
class ShmTarget:
    """A file the puller made under SHM_DIR for the server to write the payload into: its
    device and inode let the server check it opened the same file (its /dev/shm may be
    another)."""

    path: str
    device: int
    inode: int
    nbytes: int


@dataclass(frozen=True)
class ReadRequest:
    """Read these global layers [layer_start, layer_stop) and KV heads [kv_head_start,
    kv_head_stop) of these source blocks, into `shm` when given, else as bytes after the
    reply. block_size, head_dim and dtype say what the puller expects to receive."""

    token: str
    transfer_id: str
    layer_start: int
    layer_stop: int
    kv_head_start: int
    kv_head_stop: int
    block_ids: list[int]
    block_size: int
    head_dim: int
    dtype: str
    shm: ShmTarget | None = None
    version: int = PROTOCOL_VERSION

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: object) -> ReadRequest:
        """Raises ValueError naming what is malformed (a client's mistake, not the server's)."""
        if not isinstance(data, dict):
            raise ValueError("a read request is a JSON object")
        shm = data.get("shm")
        try:
            request = cls(**{**data, "shm": None if shm is None else ShmTarget(**shm)})
        except TypeError as error:
            raise ValueError(f"malformed read request: {error}") from None
        _check_types(request)
        return request

    @property
    def num_layers(self) -> int:
        return self.layer_stop - self.layer_start

    @property
    def num_kv_heads(self) -> int:
        return self.kv_head_stop - self.kv_head_start


def _check_types(request: ReadRequest) -> None:
    ints = [
        request.layer_start,
        request.layer_stop,
        request.kv_head_start,
        request.kv_head_stop,
        request.block_size,
        request.head_dim,
        request.version,
    ]
    if not isinstance(request.block_ids, list):
        raise ValueError("block_ids must be a list of integers")
    ints += request.block_ids
    if request.shm is not None:
        ints += [request.shm.device, request.shm.inode, request.shm.nbytes]
        if not isinstance(request.shm.path, str):
            raise ValueError("shm.path must be a string")
    # bool is an int to isinstance; JSON's true is no block id.
    if any(type(v) is not int for v in ints):
        raise ValueError("layer, head and block numbers must be integers")
    for name in ("token", "transfer_id", "dtype"):
        if not isinstance(getattr(request, name), str):
            raise ValueError(f"{name} must be a string")


@dataclass(frozen=True)
class ReadReply:
    """ok with the payload's size (0 for shm, which is then filled), or the reason it is not.
    `shm_unavailable`: the server could not use the file; the same read over TCP may work."""

    ok: bool
    reason: str = ""
    nbytes: int = 0
    shm_unavailable: bool = False

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: object) -> ReadReply:
        if not isinstance(data, dict):
            raise ValueError("a read reply is a JSON object")
        try:
            reply = cls(**data)
        except TypeError as error:
            raise ValueError(f"malformed read reply: {error}") from None
        if type(reply.nbytes) is not int or reply.nbytes < 0:
            raise ValueError(f"malformed read reply: nbytes {reply.nbytes!r}")
        return reply


def torch_dtype(name: str) -> torch.dtype:
    """torch.float32 for "float32"; ValueError for a name that is no torch dtype."""
    dtype = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def layer_nbytes(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes of one layer's K and V of `num_blocks` blocks and `num_kv_heads` heads."""
    element_bytes = torch.empty((), dtype=dtype).element_size()
    return 2 * num_blocks * block_size * num_kv_heads * head_dim * element_bytes


def split_address(address: str) -> tuple[str, int]:
    """("host", port) of "host:port" (an IPv6 host in brackets: "[::1]:4100")."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"a transfer address is host:port, got {address!r}")
    return host.strip("[]"), int(port)


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (for sendall and recv_into)."""
    return memoryview(tensor.view(-1).view(torch.uint8).numpy())


def encode_message(message: dict) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode()
    return _LENGTH.pack(len(body)) + body


def send_message(sock: socket.socket, message: dict, deadline: float | None = None) -> None:
    set_deadline(sock, deadline)
    sock.sendall(encode_message(message))


def recv_message(sock: socket.socket, deadline: float | None = None) -> dict | None:
    """The next message, or None when the peer closed the connection between messages.
    Raises ValueError for a message that is too long or not JSON, ConnectionError for one
    cut short, TimeoutError past `deadline` (an absolute time.monotonic() time)."""
    head = bytearray(_LENGTH.size)
    if not recv_exactly(sock, memoryview(head), deadline, eof_ok=True):
        return None
    (length,) = _LENGTH.unpack(head)
    if length > MAX_HEADER_BYTES:
        raise ValueError(f"a {length}-byte header is over the {MAX_HEADER_BYTES}-byte limit")
    body = bytearray(length)
    recv_exactly(sock, memoryview(body), deadline)
    return json.loads(body)


def recv_exactly(
    sock: socket.socket, view: memoryview, deadline: float | None = None, eof_ok: bool = False
) -> bool:
    """Fills `view` from the socket, straight into its memory. False when the peer closed
    before the first byte and `eof_ok`; ConnectionError when it closed part way."""
    got, total = 0, len(view)
    while got < total:
        set_deadline(sock, deadline)
        expect(sock, total - got)
        n = sock.recv_into(view[got:])
        if n == 0:
            if got == 0 and eof_ok:
                return False
            raise ConnectionError(f"the peer closed the connection after {got} of {total} bytes")
        got += n
    return True


def set_deadline(sock: socket.socket, deadline: float | None) -> None:
    """Gives the next socket call what is left until `deadline`; None leaves the timeout."""
    if deadline is None:
        return
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("the transfer's deadline passed")
    sock.settimeout(remaining)


def expect(sock: socket.socket, nbytes: int) -> None:
    """The next receive on `sock` waits for min(nbytes, RECV_LOW_WATER_BYTES) bytes."""
    try:
        sock.setsockopt(
            socket.SOL_SOCKET, socket.SO_RCVLOWAT, max(1, min(nbytes, RECV_LOW_WATER_BYTES))
        )
    except OSError:  # not settable here: receives wake per segment, as by default
        pass


def tune_socket(sock: socket.socket) -> None:
    """No Nagle delay: a request or reply header must not wait for more bytes. Larger
    socket buffers than the default were measured and gave nothing on loopback."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
