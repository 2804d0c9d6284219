"""Why a model's torch work stays on one thread: a SmolLM2 fp32 decode step (one running
request, `bench.step_profile`'s workload) timed on the thread that loaded the model, then on a
second thread, then on the first again.

    .venv/bin/python -m bench.omp_threads

Each Python thread that calls into OpenMP gets a libgomp thread team of its own; with two
teams on a 2-core machine every step slows, also back on the first thread. This is what
`scheduler_svc/executor.py`'s `model_thread()` avoids by loading and stepping on one thread.
"""

from __future__ import annotations

import statistics
from concurrent.futures import ThreadPoolExecutor

from bench.common import REPO_ROOT
from bench.control_plane import write_smollm2_folder
from bench.step_profile import Workload, build_runner
from kernels.cpu_features import cpu_features


def main() -> None:
    model = str(write_smollm2_folder(REPO_ROOT / ".cache" / "smollm2-hf"))
    runner = build_runner(model, "float32", "auto", "auto")
    work = Workload(runner, runner.metadata.vocab_size)
    work.run([128], decode=False, finish_new=False)

    def decode_ms(steps: int = 20) -> float:
        return 1000 * statistics.median(work.run([], decode=True)[1] for _ in range(steps))

    first = decode_ms()
    with ThreadPoolExecutor(1) as other:
        second = other.submit(decode_ms).result()
    again = decode_ms()
    print(
        f"decode1 step, median ms: loading thread {first:.1f}, second thread {second:.1f}, "
        f"loading thread again {again:.1f}; linear {runner.cpu_linear}; "
        f"{cpu_features().one_line()}"
    )


if __name__ == "__main__":
    main()
