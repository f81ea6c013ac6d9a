"""Named fault-injection points, for the fault suite (tests/pipeline/test_faults.py) and for anyone who wants to see
what a crash at a given moment leaves behind (docs/operations.md, "Faults").

`DLLM_FLOW_FAULT="<point>=<action>[@<n>][,...]"` makes the n-th time (default: the first) this process
reaches `<point>` do `<action>`:

- `kill`: SIGKILL this process (no handler, no cleanup: a power cut, an OOM kill);
- `term`: SIGTERM this process (the clean-shutdown path, dllm_common/interrupt.py);
- `enospc`: raise `OSError(ENOSPC)` (the disk is full);
- `nan`: `reached` returns True, and the caller makes its value NaN (`train.loss`: a step's loss diverges).

Points: `publish.<stage>.written` (a stage's files written, its manifest not yet), `publish.<stage>.renaming`
(the entry complete in its temp dir, not yet renamed into place), `checkpoint.written` (weights written,
the rest of the checkpoint not), `checkpoint.swap` (the old checkpoint moved out, the new one not yet in),
`checkpoint.shards` (a rank about to write its shards of a sharded checkpoint), `train.step` (the start of
each training step; `step:train[<strategy>]` for one strategy's), `train.loss` (a step's loss, all-reduced:
`nan` only), `train.update` (the weights just updated: `nan` spoils one), `record.save` (a run record
written, not yet replaced).
With the variable unset (always, outside tests) `reached` is one dictionary lookup.
"""

from __future__ import annotations

import errno
import os
import signal

ENV = "DLLM_FLOW_FAULT"
ACTIONS = ("kill", "term", "enospc", "nan")

_seen: dict[str, int] = {}


def plan(spec: str) -> dict[str, tuple[str, int]]:
    """`"a=kill@2,b=enospc"` → {"a": ("kill", 2), "b": ("enospc", 1)}; a malformed item is refused."""
    out = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        point, _, rest = item.partition("=")
        action, _, nth = rest.partition("@")
        if not point or action not in ACTIONS or (nth and not nth.isdigit()):
            raise ValueError(f"{ENV}: {item!r} is not <point>=<{'|'.join(ACTIONS)}>[@<n>]")
        out[point] = (action, int(nth or 1))
    return out


def reached(point: str) -> bool:
    """Mark `point`; inject its fault if the plan says this is the time. True when the fault is a value the
    caller must spoil (`nan`)."""
    spec = os.environ.get(ENV)
    if not spec:
        return False
    action_at = plan(spec).get(point)
    if action_at is None:
        return False
    _seen[point] = _seen.get(point, 0) + 1
    action, nth = action_at
    if _seen[point] != nth:
        return False
    if action == "nan":
        return True
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "term":
        os.kill(os.getpid(), signal.SIGTERM)
    else:
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (injected at {point})")
    return False
