"""The collectives recorder: every torch.distributed op of this process, in its ring.

Installed by :func:`install` once ``torch.distributed`` is imported (``core/torch_hook.py``
notices the import, in every Python process of the session, ranks that never import
this package included), it replaces torch.distributed's collective and point-to-point
functions, in ``torch.distributed`` and in ``torch.distributed.distributed_c10d``, by
wrappers that write one entry into the process's ring (``core/collectives.py``) when
an op starts, and mark it completed when it returns, or for an ``async_op`` when its
work completes (a callback on the work's future). The wrappers know nothing of the
backend, so they record gloo, NCCL and MPI alike.

An entry holds the op, its process group (``default`` for the world) with the group's
own sequence number of the op, the peer of a point-to-point op, the tensors' dtypes
and shapes, the user's call site, the thread, and the start and end times. Only the
outermost op of a thread is recorded: ``all_gather_object`` is one entry, not its
inner ``all_gather`` calls, so sequence numbers count the ops the user called, the
same on every rank of a correct program.

``init_process_group`` is recorded too (sequence number 0 of the default group: a
rank stuck in the rendezvous), and it labels the process ``rank N`` by its global rank
(:data:`.ranklabel.label`), unless the process set a label of its own.

Nothing here imports torch: :func:`install` runs after torch.distributed was imported
by someone else.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import os
import sys
import threading
from collections.abc import Callable
from types import CodeType, FrameType, ModuleType
from typing import Any

from pytest_elastic_timer.core import afterfork, unpatched
from pytest_elastic_timer.core import collectives as ring_format
from pytest_elastic_timer.scope import ranklabel

ENV_ADDRESS = "PYTEST_ELASTIC_TIMER"  # the session's watchdog socket, in its directory
ENV_SWITCH = "PYTEST_ELASTIC_TIMER_COLLECTIVES"  # "0": no recorder in this session
MAX_TENSORS = 8  # tensors described per op (the first ones)


# From core/unpatched.py, bound when the package was first imported: this module loads
# only once torch.distributed is imported, maybe inside a test that patched time's names.
_monotonic = unpatched.monotonic
_get_ident = threading.get_ident
_MARK = "_pytest_elastic_timer_recorded"

# op -> (kind, parameters holding tensors, peer parameter, peer-in-group parameter)
_COLLECTIVE = ring_format.COLLECTIVE
_OPS: dict[str, tuple[int, tuple[str, ...], str, str]] = {
    "all_reduce": (_COLLECTIVE, ("tensor",), "", ""),
    "all_reduce_coalesced": (_COLLECTIVE, ("tensors",), "", ""),
    "reduce": (_COLLECTIVE, ("tensor",), "", ""),
    "broadcast": (_COLLECTIVE, ("tensor",), "", ""),
    "all_gather": (_COLLECTIVE, ("tensor",), "", ""),
    "all_gather_into_tensor": (_COLLECTIVE, ("output_tensor", "input_tensor"), "", ""),
    "_all_gather_base": (_COLLECTIVE, ("output_tensor", "input_tensor"), "", ""),
    "all_gather_coalesced": (_COLLECTIVE, ("input_tensor_list",), "", ""),
    "all_gather_object": (_COLLECTIVE, (), "", ""),
    "gather": (_COLLECTIVE, ("tensor",), "", ""),
    "gather_object": (_COLLECTIVE, (), "", ""),
    "scatter": (_COLLECTIVE, ("tensor",), "", ""),
    "scatter_object_list": (_COLLECTIVE, (), "", ""),
    "broadcast_object_list": (_COLLECTIVE, (), "", ""),
    "reduce_scatter": (_COLLECTIVE, ("output",), "", ""),
    "reduce_scatter_tensor": (_COLLECTIVE, ("output", "input"), "", ""),
    "_reduce_scatter_base": (_COLLECTIVE, ("output", "input"), "", ""),
    "all_to_all": (_COLLECTIVE, ("input_tensor_list",), "", ""),
    "all_to_all_single": (_COLLECTIVE, ("output", "input"), "", ""),
    "barrier": (_COLLECTIVE, (), "", ""),
    "monitored_barrier": (_COLLECTIVE, (), "", ""),
    "send": (ring_format.SEND, ("tensor",), "dst", "group_dst"),
    "isend": (ring_format.SEND, ("tensor",), "dst", "group_dst"),
    "send_object_list": (ring_format.SEND, (), "dst", "group_dst"),
    "recv": (ring_format.RECV, ("tensor",), "src", "group_src"),
    "irecv": (ring_format.RECV, ("tensor",), "src", "group_src"),
    "recv_object_list": (ring_format.RECV, (), "src", "group_src"),
}
# Ops that return their work whatever their arguments say.
_ALWAYS_ASYNC = frozenset({"isend", "irecv"})
# The ops a batch_isend_irecv is made of, by their function's name.
_BATCHED = {"isend": ring_format.SEND, "irecv": ring_format.RECV}


def session_directory() -> str:
    """The session directory this process writes its ring into ("" outside a session)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return ""
    address = os.environ.get(ENV_ADDRESS, "")
    return os.path.dirname(address) if address else ""


class _Local(threading.local):
    depth = 0  # > 0 while the thread is inside a recorded op


class Recorder:
    """This process's recording state: its ring, groups and sequence numbers."""

    def __init__(self, dist: ModuleType) -> None:
        self.dist = dist
        self.ring: ring_format.RingWriter | None = None
        self.directory = ""
        self.local = _Local()
        self.pid = unpatched.getpid()
        # group object (None: the default group) -> (name as stored, name)
        self.groups: dict[Any, bytes] = {}
        self.seqs: dict[bytes, int] = {}
        self.p2p: dict[tuple[bytes, int, int], int] = {}
        self.sites: dict[tuple[int, int], tuple[CodeType, bytes]] = {}
        self.skip: dict[str, bool] = {}
        self.tensor_texts: dict[tuple[Any, ...], bytes] = {}
        self.dtypes: dict[Any, str] = {}
        torch = sys.modules.get("torch")
        self.tensor_type: type = getattr(torch, "Tensor", None) or type(None)

    # -- the ring ---------------------------------------------------------------------
    def writer(self) -> ring_format.RingWriter | None:
        """The ring of this process in the current session (made on first use)."""
        directory = session_directory()
        ring = self.ring
        if ring is not None and directory == self.directory:
            return ring
        if ring is not None:
            ring.close()
            self.ring = None
        self.directory = directory
        if not directory or not os.path.isdir(directory):
            return None
        try:
            ring = ring_format.RingWriter(ring_format.ring_path(directory, unpatched.getpid()))
        except OSError:
            return None
        ring.set_text(ring_format.T_NODEID, _current_test())
        ring.set_text(ring_format.T_WORKER, os.environ.get("PYTEST_XDIST_WORKER", ""))
        if ranklabel.own or ranklabel.label:
            ring.set_text(ring_format.T_LABEL, ranklabel.own or ranklabel.label)
        self.ring = ring
        # A child that multiprocessing forked ends through os._exit, after its own exit
        # functions, not atexit's: a rank that returned is "exited" there too, and only
        # one that crashed or was killed reads as "died".
        mp_util = sys.modules.get("multiprocessing.util")
        if mp_util is not None:
            mp_util.Finalize(None, _at_exit, exitpriority=0)
        return ring

    def forget(self) -> None:
        """After a fork: the child writes a ring of its own, and its groups are not
        the parent's."""
        self.ring = None  # the parent's mapping: not ours to close or write
        self.directory = ""
        self.pid = unpatched.getpid()
        self.local = _Local()
        self.reset()
        _pending.clear()

    def reset(self) -> None:
        """A new world (init_process_group) or none (destroy_process_group)."""
        self.groups.clear()
        self.seqs.clear()
        self.p2p.clear()

    def exited(self) -> None:
        if self.ring is not None and self.pid == unpatched.getpid():
            self.ring.mark_exited()

    # -- what an op is about ----------------------------------------------------------
    def group_name(self, group: Any) -> bytes:
        name = self.groups.get(group)
        if name is not None:
            return name
        dist = self.dist
        world = dist.GroupMember.WORLD
        ring = self.ring
        if group is None or group is world:
            text = ring_format.DEFAULT_GROUP
            members = list(range(dist.get_world_size()))
        else:
            text = str(group.group_name)
            members = list(dist.get_process_group_ranks(group))
        if ring is not None:
            ring.add_group(text, members)
        name = self.groups[group] = text.encode()
        return name

    def site(self, frame: FrameType | None) -> bytes:
        """``file:line`` of the user's call: the first frame outside torch.distributed."""
        skip = self.skip
        while frame is not None:
            code = frame.f_code
            filename = code.co_filename
            skipped = skip.get(filename)
            if skipped is None:
                skipped = skip[filename] = _is_torch_distributed(filename)
            if not skipped:
                # Keyed by the code's id and the bytecode offset: hashing a code
                # object hashes all of its contents, and f_lineno walks its line
                # table, every time.
                key = (id(code), frame.f_lasti)
                known = self.sites.get(key)
                if known is not None and known[0] is code:
                    return known[1]
                text = f"{filename}:{frame.f_lineno}".encode()[-200:]
                self.sites[key] = (code, text)
                return text
            frame = frame.f_back
        return b""

    def tensors(self, values: list[Any]) -> bytes:
        tensor = self.tensor_type
        found: list[Any] = []
        for value in values:
            if isinstance(value, tensor):
                found.append(value)
            elif isinstance(value, (list, tuple)):
                found.extend(v for v in value if isinstance(v, tensor))
        if not found:
            return b""
        del found[MAX_TENSORS:]
        key = tuple([(t.dtype, t.shape) for t in found])
        text = self.tensor_texts.get(key)
        if text is None:
            text = self.tensor_texts[key] = ring_format.encode_tensors(
                (self.dtype_name(dtype), tuple(shape)) for dtype, shape in key
            )
        return text

    def dtype_name(self, dtype: Any) -> str:
        name = self.dtypes.get(dtype)
        if name is None:
            name = self.dtypes[dtype] = str(dtype).removeprefix("torch.")
        return name

    # -- entries ----------------------------------------------------------------------
    def begin(
        self,
        name: bytes,
        kind: int,
        group: Any,
        peer: int,
        tensors: list[Any],
        frame: FrameType | None,
    ) -> tuple[ring_format.RingWriter, int] | None:
        ring = self.ring or self.writer()
        if ring is None:
            return None
        if _pending:
            _poll()
        group_name = self.group_name(group)
        if kind == ring_format.COLLECTIVE:
            seq = self.seqs[group_name] = self.seqs.get(group_name, 0) + 1
        else:  # point-to-point ops per direction and peer
            key = (group_name, kind, peer)
            seq = self.p2p[key] = self.p2p.get(key, 0) + 1
        serial = ring.begin(
            kind,
            name,
            group_name,
            seq,
            peer,
            self.site(frame),
            self.tensors(tensors) if tensors else b"",
            _get_ident(),
            _monotonic(),
        )
        return ring, serial


_recorder: Recorder | None = None


def _is_torch_distributed(filename: str) -> bool:
    parts = filename.replace(os.sep, "/")
    return "/torch/distributed/" in parts or parts.endswith("/scope/collectives.py")


def _current_test() -> str:
    """The test of the pytest process this process runs below ("" if none)."""
    return os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]


def _world_id(init_method: Any, store: Any) -> str:
    """How the ranks of this world met, the same text on each of them."""
    if isinstance(init_method, str) and init_method and not init_method.startswith("env://"):
        return init_method
    if store is not None:
        # A PrefixStore (torchrun's, or the program's own) names no place of its own:
        # the store it wraps does. Its prefix is the same text on every rank.
        for _ in range(8):
            inner = getattr(store, "underlying_store", None)
            if inner is None:
                break
            store = inner
        for attrs in (("host", "port"), ("path",)):
            values = [getattr(store, a, None) for a in attrs]
            if all(v is not None for v in values):
                return f"{type(store).__name__}:{':'.join(map(str, values))}"
        return ""
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return f"tcp://{addr}:{port}" if addr and port else ""


def _param(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str) -> Any:
    if 0 <= index < len(args):
        return args[index]
    return kwargs.get(name)


def _completion(ring: ring_format.RingWriter, serials: tuple[int, ...], works: Any) -> None:
    """Mark the entries ``serials`` completed once every work of their async op (or
    batch) has completed."""
    items = works if isinstance(works, list) else [works]
    items = [w for w in items if w is not None]
    if not items:
        for serial in serials:
            ring.complete(serial)
        return
    left = [len(items)]
    lock = threading.Lock()

    def done(_: Any) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            for serial in serials:
                ring.complete(serial)

    for work in items:
        try:
            future = work.get_future()
        except Exception:  # gloo's send and recv works have none
            future = None
        if future is not None:
            future.add_done_callback(done)
        else:
            _await(work, done)


# Works without a future: id -> (work, callback), completed by Work.wait or seen
# completed by the next op's poll.
_pending: dict[int, tuple[Any, Callable[[Any], None]]] = {}


def _await(work: Any, done: Callable[[Any], None]) -> None:
    cls = type(work)
    if not getattr(cls.wait, _MARK, False):
        original = cls.wait

        def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return original(self, *args, **kwargs)
            finally:
                waiting = _pending.pop(id(self), None)
                if waiting is not None and waiting[0] is self:
                    waiting[1](None)

        functools.update_wrapper(wait, original)
        setattr(wait, _MARK, True)
        cls.wait = wait
    _pending[id(work)] = (work, done)


def _poll() -> None:
    """Complete the works without a future that completed by themselves."""
    for key, (work, done) in list(_pending.items()):
        try:
            finished = work.is_completed()
        except Exception:
            finished = True
        if finished and _pending.pop(key, None) is not None:
            done(None)


def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (torch.distributed's op ``name``, or anything with its signature) with
    each call recorded while the recorder is on."""
    kind, tensor_params, peer_param, group_peer_param = _OPS[name]
    params = list(inspect.signature(fn).parameters)

    def index(param: str) -> int:
        return params.index(param) if param in params else -1

    group_at = index("group")
    async_at = index("async_op")
    tensors_at = [(index(p), p) for p in tensor_params if p in params]
    peer_at = (index(peer_param), peer_param) if peer_param else None
    group_peer_at = (index(group_peer_param), group_peer_param) if group_peer_param else None
    always_async = name in _ALWAYS_ASYNC
    op_name = name.encode()

    @functools.wraps(fn)
    def op(*args: Any, **kwargs: Any) -> Any:
        recorder = _recorder
        if recorder is None:
            return fn(*args, **kwargs)
        local = recorder.local
        if local.depth:  # inside an op this thread called: counted there
            return fn(*args, **kwargs)
        try:
            group = _param(args, kwargs, group_at, "group")
            peer = -1
            if peer_at is not None:
                value = _param(args, kwargs, *peer_at)
                if value is None and group_peer_at is not None:
                    in_group = _param(args, kwargs, *group_peer_at)
                    if in_group is not None:
                        value = recorder.dist.get_global_rank(group, in_group)
                peer = -1 if value is None else int(value)
            tensors = [_param(args, kwargs, i, p) for i, p in tensors_at] if tensors_at else []
            begun = recorder.begin(op_name, kind, group, peer, tensors, sys._getframe(1))
        except Exception:  # not a valid call: torch says why, unrecorded
            begun = None
        if begun is None:
            return fn(*args, **kwargs)
        ring, serial = begun
        local.depth += 1
        try:
            result = fn(*args, **kwargs)
        except BaseException:
            ring.complete(serial, ring_format.FAILED)
            raise
        finally:
            local.depth -= 1
        if always_async or (async_at >= 0 and _param(args, kwargs, async_at, "async_op")):
            _completion(ring, (serial,), result)
        else:
            ring.complete(serial)
        return result

    # Stacks and tracebacks name this frame after the op it records, not "op".
    code: CodeType = op.__code__  # type: ignore[attr-defined]
    op.__code__ = code.replace(co_name=name)  # type: ignore[attr-defined]
    setattr(op, _MARK, True)
    return op


def _wrap_batch(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``batch_isend_irecv`` with each op of the batch recorded as the ``isend`` or
    ``irecv`` it is, numbered per direction and peer as those are: the k-th send from
    rank 0 to rank 1 meets rank 1's k-th receive from rank 0, batched or not, as the
    transport matches them. (Numbered as one op of the group, batches would line up
    only where every rank makes as many of them, which a pipeline's stages do not.)"""

    @functools.wraps(fn)
    def batch_isend_irecv(*args: Any, **kwargs: Any) -> Any:
        recorder = _recorder
        if recorder is None or recorder.local.depth:
            return fn(*args, **kwargs)
        begun: list[tuple[ring_format.RingWriter, int]] = []
        try:
            ops = [
                (_BATCHED[p2p.op.__name__], p2p.group, int(p2p.peer), p2p.tensor)
                for p2p in _param(args, kwargs, 0, "p2p_op_list")
            ]
            for _, group, _, _ in ops:
                recorder.group_name(group)  # what can fail, before an op is numbered
            frame = sys._getframe(1)
            for kind, group, peer, tensor in ops:
                name = b"isend" if kind == ring_format.SEND else b"irecv"
                entry = recorder.begin(name, kind, group, peer, [tensor], frame)
                if entry is not None:
                    begun.append(entry)
        except Exception:  # not a valid batch (torch says why), unrecorded
            for ring, serial in begun:
                ring.complete(serial, ring_format.FAILED)
            if not begun:
                return fn(*args, **kwargs)
            begun = []  # numbered already: the ops torch makes inside are not counted
        serials = [serial for _, serial in begun]
        recorder.local.depth += 1  # the isend and irecv calls the batch makes
        try:
            works = fn(*args, **kwargs)
        except BaseException:
            for ring, serial in begun:
                ring.complete(serial, ring_format.FAILED)
            raise
        finally:
            recorder.local.depth -= 1
        if not begun:
            return works
        ring = begun[0][0]
        if isinstance(works, list) and len(works) == len(serials):
            for serial, work in zip(serials, works, strict=True):
                _completion(ring, (serial,), work)
        else:  # coalesced into fewer works: the ops complete together
            _completion(ring, tuple(serials), works)
        return works

    setattr(batch_isend_irecv, _MARK, True)
    return batch_isend_irecv


def _wrap_init(fn: Callable[..., Any]) -> Callable[..., Any]:
    params = list(inspect.signature(fn).parameters)

    @functools.wraps(fn)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        recorder = _recorder
        if recorder is None:
            return fn(*args, **kwargs)
        bound = dict(zip(params, args, strict=False), **kwargs)
        recorder.reset()
        begun = None
        try:
            ring = recorder.writer()
            if ring is not None:
                ring.set_text(ring_format.T_NODEID, _current_test())
                ring.set_text(
                    ring_format.T_WORLD_ID, _world_id(bound.get("init_method"), bound.get("store"))
                )
                rank = _int(bound.get("rank"), os.environ.get("RANK"))
                world = _int(bound.get("world_size"), os.environ.get("WORLD_SIZE"))
                if rank >= 0:  # known before the rendezvous: name a rank stuck in it
                    label = ranklabel.own or ranklabel.label or f"rank {rank}"
                    ring.set_rank(rank, max(world, 0), label)
                if world > 0:
                    ring.add_group(ring_format.DEFAULT_GROUP, range(world))
                serial = ring.begin(
                    ring_format.INIT,
                    b"init_process_group",
                    ring_format.DEFAULT_GROUP.encode(),
                    0,
                    -1,
                    recorder.site(sys._getframe(1)),
                    b"",
                    _get_ident(),
                    _monotonic(),
                )
                begun = (ring, serial)
        except Exception:
            begun = None
        try:
            result = fn(*args, **kwargs)
        except BaseException:
            if begun is not None:
                begun[0].complete(begun[1], ring_format.FAILED)
            raise
        recorder.reset()
        _adopt_rank(recorder, begun)
        return result

    setattr(init_process_group, _MARK, True)
    return init_process_group


def _adopt_rank(recorder: Recorder, begun: tuple[ring_format.RingWriter, int] | None) -> None:
    """After init_process_group: the ring says which rank this is, and the process is
    labelled ``rank N``."""
    dist = recorder.dist
    try:
        rank, world = int(dist.get_rank()), int(dist.get_world_size())
    except Exception:
        return
    label = f"rank {rank}"
    if begun is not None:
        ring, serial = begun
        ring.set_rank(rank, world, ranklabel.own or label)
        recorder.group_name(None)  # the default group's members, in the ring
        ring.complete(serial)
    ranklabel.set_label(label)


def _wrap_destroy(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        result = fn(*args, **kwargs)
        recorder = _recorder
        if recorder is not None:
            group = args[0] if args else kwargs.get("group")
            if group is None:
                recorder.reset()
                ranklabel.set_label("")  # no rank any more
            else:
                recorder.groups.pop(group, None)
        return result

    setattr(destroy_process_group, _MARK, True)
    return destroy_process_group


def _int(*values: Any) -> int:
    for value in values:
        if value is None:
            continue
        try:
            number = int(value)
        except (TypeError, ValueError):
            continue
        if number >= 0:
            return number
    return -1


def install() -> bool:
    """Record the ops of this process, in the session's directory. Called once
    torch.distributed is imported; returns whether the recorder is on. Idempotent."""
    global _recorder
    if _recorder is not None:
        return True
    if not session_directory():
        return False
    dist = sys.modules.get("torch.distributed")
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    if dist is None or c10d is None or not dist.is_available():
        return False
    wrappers: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
        name: functools.partial(wrap, name) for name in _OPS
    }
    wrappers["batch_isend_irecv"] = _wrap_batch
    wrappers["init_process_group"] = _wrap_init
    wrappers["destroy_process_group"] = _wrap_destroy
    for name, make in wrappers.items():
        original = getattr(c10d, name, None)
        if original is None or getattr(original, _MARK, False):
            continue
        wrapped = make(original)
        setattr(c10d, name, wrapped)
        if getattr(dist, name, None) is original:
            setattr(dist, name, wrapped)
    _recorder = Recorder(dist)
    atexit.register(_at_exit)
    afterfork.call_in_child(_after_fork)
    ranklabel.own_listeners.append(_relabel_ring)
    return True


def _relabel_ring(label: str) -> None:
    """The process named itself ``label``: its ring says so from now on."""
    recorder = _recorder
    if recorder is not None and recorder.ring is not None and recorder.pid == unpatched.getpid():
        recorder.ring.set_text(ring_format.T_LABEL, label)


def _at_exit() -> None:
    if _recorder is not None:
        _recorder.exited()


def _after_fork() -> None:
    if _recorder is not None:
        _recorder.forget()
    ranklabel.forget()


def recorder() -> Recorder | None:
    """This process's recorder (None until :func:`install` found a session)."""
    return _recorder


def watch() -> None:
    """Install the recorder once torch.distributed is imported (now, if it is)."""
    from pytest_elastic_timer.core import torch_hook

    torch_hook.watch()
