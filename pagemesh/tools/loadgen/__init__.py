"""`pagemesh bench`: a load generator for a running router (gRPC or OpenAI HTTP).

The plain-function API, for scripts and the peer runners:

    from pagemesh.tools.loadgen import Target, build_workload, run_workload, write_report
    result = run_workload(Target("127.0.0.1:50051"), build_workload("w64"), concurrency=16)
    write_report([result], "reports", "w64-c16")   # reports/w64-c16.{md,json} and plots
"""

from pagemesh.tools.loadgen.client import ModelInfo, Target
from pagemesh.tools.loadgen.report import load_results, markdown_table, write_report
from pagemesh.tools.loadgen.runner import Level, fetch_model_info, run_sweep, run_workload
from pagemesh.tools.loadgen.workloads import (
    WORKLOADS,
    BenchRequest,
    Workload,
    build_workload,
    poisson_arrivals,
)

__all__ = [
    "WORKLOADS",
    "BenchRequest",
    "Level",
    "ModelInfo",
    "Target",
    "Workload",
    "build_workload",
    "fetch_model_info",
    "load_results",
    "markdown_table",
    "poisson_arrivals",
    "run_sweep",
    "run_workload",
    "write_report",
]
