"""`python -m tests.support.affinity_probe OUT`: writes to OUT (JSON) where this process was
started to run, then, after one OpenMP region in torch, where each of its threads may run
and torch's thread count. (Loading an OpenMP runtime told to bind moves the loading thread
to the first place: the process's mask is read before torch loads.)"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    started_on = sorted(os.sched_getaffinity(0))
    import torch

    torch.ones(2048, 2048).sum()  # an OpenMP region: its team exists (and is bound) now
    threads = [sorted(os.sched_getaffinity(int(tid))) for tid in os.listdir("/proc/self/task")]
    with open(sys.argv[1], "w") as out:
        json.dump(
            {"affinity": started_on, "threads": threads, "torch_threads": torch.get_num_threads()},
            out,
        )


if __name__ == "__main__":
    main()
