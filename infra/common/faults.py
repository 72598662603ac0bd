"""Named fault points for the fault-injection suite (tests/faults/).

`fault_point("trainer.after_complete")` is a no-op unless the environment variable OSD_FAULT
names that point; then the process SIGKILLs itself there, as an OOM kill or a lost node would:
no finally blocks, no atexit, no flush. The suite starts real processes with OSD_FAULT set and
checks what the next process finds. One environment lookup per call: cheap enough to leave in
the production paths, which is the point (the tests kill the code that runs, not a copy).

The points: trainer.mid_step, trainer.after_complete (checkpoint COMPLETE, records not yet
acked), trainer.before_publish, registry.before_manifest (payload copied, no manifest) and
rollout.after_alias_move (after any alias the controller moves).
"""

from __future__ import annotations

import os
import signal

ENV = "OSD_FAULT"


def fault_point(name: str) -> None:
    if os.environ.get(ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)
