"""Worker for tests/launch/test_failure.py: rank 1 raises, SIGKILLs itself, or stalls while alive,
while
rank 0 waits in an all-reduce; the job must end non-zero within the time-outs instead of hanging.
argv: MODE [STATUS_DIR] (the watchdog's rank-status folder)."""
import os
import signal
import sys
import time

import numpy as np

from ms_llm.compat import setup_device

setup_device("CPU")
from mindspore import Tensor  # noqa: E402

from ms_llm.parallel import comm  # noqa: E402
from ms_llm.parallel.runtime import init_distributed  # noqa: E402

info = init_distributed()
mode = sys.argv[1]
comm.set_collective_timeout(5.0)
if len(sys.argv) > 2:   # the ranks' status folder: the time-out report names the stalled rank
    from ms_llm.parallel.comm.watchdog import note_step, set_status_dir
    set_status_dir(sys.argv[2])
for step in range(1000):
    if len(sys.argv) > 2:
        note_step(step)
    if info.rank == 1 and step == 3 and mode == "stall":
        print("rank 1 stalling (alive, never joins the next all-reduce)", flush=True)
        time.sleep(3600)
    if info.rank == 1 and step == 3:
        print(f"rank 1 failing now ({mode})", flush=True)
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError("deliberate failure on rank 1 at step 3")
    t = Tensor(np.ones(4, np.float32))
    comm.all_reduce(t)
    time.sleep(0.1)
print("unreachable: rank", info.rank, flush=True)
