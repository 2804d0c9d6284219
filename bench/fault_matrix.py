"""The fault matrix: every process of the mesh killed, frozen or cut off while clients stream,
with the figures Dynamo publishes for its own (requests sent and failed) and more.

    .venv/bin/python -m bench.fault_matrix [--clients 32] [--requests 4] [--max-tokens 48]
                                           [--scenarios NAME,...] [--name FILE]

For each mesh (bench/faults/targets.py) the workload — N clients, each sending M streamed
requests one after another, every one asking for logprobs, a quarter of them seeded samples
(bench/faults/workload.py) — runs once undisturbed, then once per scenario
(bench/faults/scenarios.py) with the fault injected once tokens flow. A client whose stream
breaks resumes it by request id, as pagemesh's clients are meant to. Per scenario:

- requests sent, failed (ended with an error), resumed (needed a client-side resume);
- the longest stall: the longest any client waited between two chunks of one request;
- time to detect and to recover, seconds after the fault, as judged from outside: the
  registry, the router's health, the processes (each scenario says how);
- identical: every request gave the undisturbed run's tokens, and logprobs within 1e-4;
- JSON valid: the constrained requests (a third, JSON-schema structured output) that ended
  before max_tokens, out of all constrained ones, whose output validates against the schema.

Writes bench/results/fault_matrix.{md,json}; tests/e2e/test_fault_matrix.py runs the same
scenarios with fewer requests. The `partition` and `pd-partition` meshes need root (network
namespaces) and are skipped without.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.common import write_results
from bench.faults.baseline import Baseline
from bench.faults.scenarios import SCENARIOS, Scenario
from bench.faults.targets import (
    HOST_TIER_DIR,
    RestartableValkey,
    Target,
    llava_images,
    load_lora_at_run_time,
    start_mesh,
    start_partition_mesh,
    start_pd_partition_mesh,
    write_llava_model,
    write_lora_adapters,
    write_model,
    write_moe_model,
)
from bench.faults.workload import Clients, RequestResult, RequestSpec, plan
from pagemesh.tools.testing.netns import namespaces_unavailable
from protos.pagemesh.v1 import generate_pb2

WATCH_TIMEOUT_S = 120.0
SPEC_CONFIG = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}
COLUMNS = [
    "scenario",
    "requests sent",
    "failed",
    "resumed",
    "longest client stall, s",
    "time to detect, s",
    "time to recover, s",
    "tokens identical",
    "JSON valid",
    "notes",
]
# How each target is started, and how many ready workers it has at rest.
TARGETS = {
    "single": ([], 1),
    "parallel": (["--tp", "2", "--pp", "2", "--standby", "1"], 4),
    "prefill": (
        [
            "--step-watchdog-s",
            "0.05",
            "--max-num-batched-tokens",
            "32768",
            "--no-enable-chunked-prefill",
        ],
        1,
    ),
    "partition": ([], 2),
    # A mixture-of-experts model (bench.faults.targets.write_moe_model), its experts placed
    # whole on the two ranks: a rank's death takes half the experts with it.
    "moe-ep": (
        ["--tp", "2", "--enable-expert-parallel", "--eplb-interval-steps", "4", "--standby", "1"],
        2,
    ),
    # A tiny LLaVA, every request with an image; prefills chunked through the images.
    "llava": (["--max-num-batched-tokens", "48"], 1),
    # Two LoRA adapters and the base in every step (one adapter loaded at run time).
    "lora": (["--dtype", "float32", "--enable-lora", "--max-loras", "2"], 1),
    # n-gram speculative decoding on one-token n-grams: drafts in most steps, most rejected.
    # fp32: a drafted step computes its rows as a chunk (the prefill's attention), a plain
    # one as decodes; in bf16 their logprobs differ beyond the matrix's 1e-4 (bf16 matmuls
    # are not batch invariant: bench.spec_decode --batch-variance).
    "spec": (["--dtype", "float32", "--speculative-config", json.dumps(SPEC_CONFIG)], 1),
    # Disaggregated: each request prefilled on prefill0, continued on a decode group that
    # pulls its KV.
    "pd": (["--prefill-replicas", "1", "--decode-replicas", "2"], 3),
    # A host KV tier in /dev/shm that a restarted worker's requests reload their blocks from.
    "tier": (["--host-tier-gib", "0.25", "--host-tier-dir", HOST_TIER_DIR], 1),
    "pd-partition": ([], 2),  # a prefill worker (and a standby), a decode worker
}
NETNS_TARGETS = ("partition", "pd-partition")  # they need network namespaces


@dataclass
class Row:
    scenario: str
    target: str
    sent: int
    failed: int
    resumed: int
    longest_stall_s: float
    detect_s: float | None
    recover_s: float | None
    identical: bool
    constrained_valid: int  # constrained requests that ended and validate
    constrained_ended: int  # constrained requests that ended (EOS), of `constrained`
    constrained: int
    notes: str
    errors: list[str]

    def cells(self) -> list[str]:
        def seconds(value: float | None) -> str:
            return "—" if value is None else f"{value:.1f}"

        return [
            self.scenario,
            str(self.sent),
            str(self.failed),
            str(self.resumed),
            f"{self.longest_stall_s:.1f}",
            seconds(self.detect_s),
            seconds(self.recover_s),
            "yes" if self.identical else "NO",
            f"{self.constrained_valid}/{self.constrained_ended} of {self.constrained}",
            self.notes,
        ]


class Watcher:
    """Polls a scenario's `detected` and `recovered` from the fault on (every 50 ms)."""

    def __init__(self, target: Target, scenario: Scenario, base: Baseline) -> None:
        self.target, self.scenario, self.base = target, scenario, base
        self.started_at = time.monotonic()
        self.detected_at: float | None = None
        self.recovered_at: float | None = None
        self.done = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while time.monotonic() - self.started_at < WATCH_TIMEOUT_S and not self.scenario.no_fault:
            try:
                if self.detected_at is None and self.scenario.detected(self.target, self.base):
                    self.detected_at = time.monotonic()
                if self.detected_at is not None and self.scenario.recovered(self.target, self.base):
                    self.recovered_at = time.monotonic()
                    break
            except Exception:  # Redis away during a Redis fault: not yet
                pass
            time.sleep(0.05)
        self.done.set()

    def seconds(self, at: float | None) -> float | None:
        return None if at is None else at - self.started_at


def run_scenario(
    target: Target,
    scenario: Scenario,
    clients: Clients,
    reference: list[RequestResult],
    num_clients: int,
    requests_per_client: int,
    max_tokens: int,
) -> Row:
    base = Baseline.of(target)
    action = scenario.prepare(target, base)
    watcher: list[Watcher] = []

    def disturb() -> None:
        if scenario.aim is not None:
            scenario.aim(target, base)
        watcher.append(Watcher(target, scenario, base))
        action()

    tag = scenario.name.replace(" ", "-")
    workload = target_plan(target, num_clients, requests_per_client, max_tokens, tag)
    # A quarter of the way in: with M > 1 requests per client, some requests are mid-stream
    # and others not sent yet. Or early, as the first tokens arrive.
    total_tokens = num_clients * requests_per_client * max_tokens
    after_tokens = max(num_clients // 2, 1) if scenario.strike_early else total_tokens // 4
    run = clients.run(workload, disturb, after_tokens=after_tokens)
    watcher[0].done.wait(WATCH_TIMEOUT_S)
    scenario.after(target, base)
    failed = [r for r in run.results if r.error is not None]
    constrained = [r for r in run.results if r.spec.constrained]
    ended = [r for r in constrained if r.finish_reason == generate_pb2.FINISH_REASON_STOP]
    return Row(
        scenario.name,
        target.name,
        len(run.results),
        len(failed),
        sum(r.num_resumes > 0 for r in run.results),
        max(r.longest_gap_s for r in run.results),
        watcher[0].seconds(watcher[0].detected_at),
        watcher[0].seconds(watcher[0].recovered_at),
        all(r.same_as(ref) for r, ref in zip(run.results, reference)),
        sum(r.schema_valid() for r in ended),
        len(ended),
        len(constrained),
        "; ".join(n for n in (scenario.notes, *base.notes) if n),
        [f"{r.spec.request_id}: {r.error}" for r in failed][:5],
    )


def target_plan(
    target: Target, num_clients: int, requests_per_client: int, max_tokens: int, tag: str
) -> list[list[RequestSpec]]:
    """The workload for `target`: its requests show its images, if it has any."""
    return plan(
        num_clients,
        requests_per_client,
        max_tokens,
        tag,
        images=target.images,
        image_token_id=target.image_token_id,
        adapters=target.adapters,
    )


def start_target(name: str, model: Path, log_dir: Path) -> Target:
    if name == "partition":
        return start_partition_mesh(model, log_dir)
    if name == "pd-partition":
        return start_pd_partition_mesh(model, log_dir)
    extra, _ = TARGETS[name]
    if name == "moe-ep":
        model = write_moe_model(model.parent / "tiny-moe")
    if name == "llava":
        model = write_llava_model(model.parent / "tiny-llava")
    if name == "lora":
        adapters = write_lora_adapters(model)
        extra = [*extra, "--lora-modules", f"sql={adapters['sql']}"]
    target = start_mesh(
        name, model, log_dir, extra, RestartableValkey() if name == "parallel" else None
    )
    if name == "lora":
        load_lora_at_run_time(target, "late", adapters["late"])
        target.adapters = ("sql", "late")
    if name == "llava":
        config = json.loads((model / "config.json").read_text())
        target.images, target.image_token_id = llava_images(), config["image_token_index"]
    return target


def wait_ready(target: Target, timeout_s: float = 180) -> None:
    """Back at rest before the next scenario: serving, every group ready, every rank filled."""
    deadline = time.monotonic() + timeout_s
    while not target.ready(TARGETS[target.name][1]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"mesh {target.name} not back at rest:\n{target.log()}")
        time.sleep(0.5)


def run_matrix(
    scenarios: list[Scenario],
    num_clients: int,
    requests_per_client: int,
    max_tokens: int,
    log_dir: Path,
    model: Path,
) -> list[Row]:
    rows: list[Row] = []
    for target_name in dict.fromkeys(s.target for s in scenarios):
        target = start_target(target_name, model, log_dir)
        clients = Clients(target.address)
        try:
            wait_ready(target)
            calm = clients.run(
                target_plan(target, num_clients, requests_per_client, max_tokens, "calm")
            ).results
            errors = [r.error for r in calm if r.error]
            assert not errors, f"the undisturbed run failed: {errors[:3]}"
            for scenario in (s for s in scenarios if s.target == target_name):
                wait_ready(target)
                rows.append(
                    run_scenario(
                        target,
                        scenario,
                        clients,
                        calm,
                        num_clients,
                        requests_per_client,
                        max_tokens,
                    )
                )
                print(" | ".join(rows[-1].cells()), flush=True)
        finally:
            clients.close()
            target.stop()
    return rows


def select(names: str | None) -> list[Scenario]:
    scenarios = (
        SCENARIOS
        if not names
        else [s for s in SCENARIOS if s.name in names.split(",") or s.target in names.split(",")]
    )
    why = namespaces_unavailable()
    if why is not None:
        print(f"skipping the partition scenarios: {why}")
        scenarios = [s for s in scenarios if s.target not in NETNS_TARGETS]
    return scenarios


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=4, help="requests per client")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--scenarios", help="comma-separated scenario or mesh names (default: all)")
    parser.add_argument(
        "--name",
        default="fault_matrix",
        help="the results' file name in bench/results (a subset's own record)",
    )
    args = parser.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="fault-matrix-"))
    model = write_model(Path(tempfile.mkdtemp(prefix="fault-matrix-model-")) / "tiny")
    rows = run_matrix(
        select(args.scenarios), args.clients, args.requests, args.max_tokens, log_dir, model
    )
    write_results(
        args.name,
        f"Fault matrix: {args.clients} clients x {args.requests} streamed requests x "
        f"{args.max_tokens} tokens per scenario, tiny Llama, CPU (bench/fault_matrix.py); "
        f"logs in {log_dir}",
        COLUMNS,
        [row.cells() for row in rows],
        [asdict(row) for row in rows],
    )


if __name__ == "__main__":
    main()
