"""The words of the synchronization primitives on the watchdog's socket, shared by the
client (:mod:`.client`, in test processes) and the server (:mod:`.server`, in the
watchdog). Imports nothing."""

OP_BARRIER = "sync.barrier"
OP_EVENT_SET = "sync.event.set"
OP_EVENT_CLEAR = "sync.event.clear"
OP_EVENT_GET = "sync.event.get"
OP_EVENT_WAIT = "sync.event.wait"
OP_LOCK_ACQUIRE = "sync.lock.acquire"
OP_LOCK_RELEASE = "sync.lock.release"  # from the holder: release; from a waiter: give up
OPS = (
    OP_BARRIER,
    OP_EVENT_SET,
    OP_EVENT_CLEAR,
    OP_EVENT_GET,
    OP_EVENT_WAIT,
    OP_LOCK_ACQUIRE,
    OP_LOCK_RELEASE,
)
# Answers.
OK = "sync.ok"
TIMEOUT = "sync.timeout"
ERROR = "sync.error"

MAX_NAME = 1000  # characters of a primitive's name (and of a label)
MAX_PARTIES = 100_000
MAX_STACK = 64_000
