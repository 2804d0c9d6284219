"""`pagemesh bench` (pagemesh/tools/loadgen): workloads, timing and reports as pure functions, then
the
load generator against a real mesh (tiny random Llama) over gRPC and over HTTP."""

from __future__ import annotations

import argparse
import json
import math
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kernels.cpu_features import cpu_features
from pagemesh.runtime.ports import reserve_port
from pagemesh.tools.loadgen import cli
from pagemesh.tools.loadgen.client import Target, reconcile
from pagemesh.tools.loadgen.machine import machine_markdown
from pagemesh.tools.loadgen.report import load_results, markdown_table, write_report
from pagemesh.tools.loadgen.result import RunResult
from pagemesh.tools.loadgen.runner import (
    Level,
    fetch_model_info,
    run_sweep,
    run_workload,
    token_samples,
)
from pagemesh.tools.loadgen.workloads import (
    BenchRequest,
    Workload,
    build_workload,
    poisson_arrivals,
    shared_prefix,
    sharegpt_like,
)
from pagemesh.tools.testing.tiny_models import write_tiny_model
from tests.support.mesh_harness import Mesh
from tests.support.tls_certs import CertFiles, make_certs

# ---------------------------------------------------------------- workloads


def test_w64_prompts_are_bench_commons() -> None:
    from bench.common import w64_workload

    args = argparse.Namespace(model="unused", num_requests=64, prompt_len=128, max_tokens=128)
    _, expected = w64_workload(args)
    workload = build_workload("w64")
    assert [r.prompt_token_ids for r in workload.requests] == expected
    assert {r.max_tokens for r in workload.requests} == {128}
    # A vocabulary above 32000 keeps the same prompts; a smaller one bounds the ids.
    assert build_workload("w64", vocab_size=128256) == workload
    small = build_workload("w64", vocab_size=512, num_requests=3, prompt_len=8, max_tokens=4)
    assert all(1 <= t < 512 for r in small.requests for t in r.prompt_token_ids)
    assert [(len(r.prompt_token_ids), r.max_tokens) for r in small.requests] == [(8, 4)] * 3


@pytest.mark.parametrize("name", ["w64", "sharegpt-like", "shared-prefix"])
def test_workloads_are_deterministic(name: str) -> None:
    assert build_workload(name, seed=3) == build_workload(name, seed=3)
    assert build_workload(name, seed=3) != build_workload(name, seed=4)
    assert len(build_workload(name, num_requests=7).requests) == 7


def test_sharegpt_like_lengths() -> None:
    workload = sharegpt_like(num_requests=2000, vocab_size=1000)
    prompts = sorted(len(r.prompt_token_ids) for r in workload.requests)
    outputs = sorted(r.max_tokens for r in workload.requests)
    assert 4 <= prompts[0] and prompts[-1] <= 1024 and 4 <= outputs[0] and outputs[-1] <= 512
    assert 170 <= prompts[1000] <= 230 and 125 <= outputs[1000] <= 175  # medians 200 / 150
    assert prompts[-1] == 1024 and outputs[-1] == 512  # the long tail reaches the clips
    assert all(1 <= t < 1000 for r in workload.requests for t in r.prompt_token_ids)
    scaled = sharegpt_like(num_requests=500, prompt_len=20, max_tokens=10)
    assert max(len(r.prompt_token_ids) for r in scaled.requests) <= round(1024 * 20 / 200)
    assert max(r.max_tokens for r in scaled.requests) <= round(512 * 10 / 150)


def test_shared_prefix_tenants() -> None:
    workload = shared_prefix(num_requests=40, vocab_size=1000)
    prefixes = {tuple(r.prompt_token_ids[:512]) for r in workload.requests}
    assert len(prefixes) == 4
    assert all(32 <= len(r.prompt_token_ids) - 512 <= 64 for r in workload.requests)
    assert {r.max_tokens for r in workload.requests} == {64}
    suffixes = {tuple(r.prompt_token_ids[512:]) for r in workload.requests}
    assert len(suffixes) == 40
    two = build_workload("shared-prefix", num_tenants=2, prompt_len=16, max_tokens=5)
    assert len({tuple(r.prompt_token_ids[:16]) for r in two.requests}) == 2
    with pytest.raises(ValueError, match="shared-prefix"):
        build_workload("w64", num_tenants=2)


def test_poisson_arrivals_come_from_the_seed() -> None:
    times = poisson_arrivals(4000, 10.0, seed=5)
    assert times == poisson_arrivals(4000, 10.0, seed=5)
    assert times != poisson_arrivals(4000, 10.0, seed=6)
    assert times[0] == 0.0 and all(b >= a for a, b in zip(times, times[1:]))
    assert times[-1] / (len(times) - 1) == pytest.approx(0.1, rel=0.08)  # mean gap 1 / rate


# ---------------------------------------------------------------- timing and reports


def test_chunk_of_k_tokens_gives_k_minus_1_zero_gaps() -> None:
    ttft, gaps, e2e = token_samples(10.0, [(10.5, 2), (10.75, 1), (11.0, 3)])
    assert ttft == 0.5 and e2e == 1.0
    assert gaps == [0.0, 0.25, 0.25, 0.0, 0.0]  # 6 tokens, 5 gaps
    # HTTP: the usage count decides; missing tokens join the last event, extra events go.
    assert reconcile([(1.0, 1), (2.0, 1)], 4) == [(1.0, 1), (2.0, 3)]
    assert reconcile([(1.0, 1), (2.0, 1), (3.0, 1)], 2) == [(1.0, 1), (2.0, 1)]
    assert reconcile([(1.0, 1)], None) == [(1.0, 1)]


def _result(engine: str, concurrency: int, tok_s: float, **kwargs: object) -> RunResult:
    return RunResult(
        engine=engine,
        workload="w64",
        dtype="float32",
        concurrency=concurrency,
        num_requests=10,
        prompt_tokens=1280,
        output_tokens=round(tok_s * 2),
        duration_s=2.0,
        ttft_ms=[10.0, 20.0, 30.0],
        itl_ms=[0.0, 5.0],
        e2e_ms=[100.0, 200.0, 300.0],
        **kwargs,
    )


def test_markdown_table_ratios() -> None:
    runs = [
        _result("peer", 1, 50.0),
        _result("peer", 4, 100.0),
        _result("pagemesh gRPC", 1, 100.0),
        _result("pagemesh gRPC", 4, 400.0),
        _result("pagemesh gRPC", 0, 300.0, request_rate=2.5, num_errors=1),
    ]
    rows = markdown_table(runs).splitlines()
    assert rows[0].startswith("| engine | workload | concurrency / rate | output tok/s | req/s")
    assert rows[0].endswith("| errors | vs peer @ 1 |")
    assert [row.split(" | ")[-1] for row in rows[2:]] == [
        "1.00x |",
        "2.00x |",
        "2.00x |",
        "8.00x |",
        "6.00x |",
    ]
    assert "| 2.5 req/s |" in rows[6] and "| 1 | 6.00x |" in rows[6]
    assert "| 20.0 / 28.0 / 29.8 |" in rows[2]  # TTFT p50 / p90 / p99
    # --baseline: each row against that engine's run at the same load (else its first).
    rows = markdown_table(runs, baseline="peer").splitlines()
    assert rows[0].endswith("| vs peer |")
    assert [row.split(" | ")[-1] for row in rows[2:]] == [
        "1.00x |",
        "1.00x |",
        "2.00x |",
        "4.00x |",
        "6.00x |",
    ]
    empty = RunResult("offline", "w64", "bf16", 0, 10, 1280, 1280, 1.0)
    assert "| – | – | – |" in markdown_table([empty])


def test_report_files_without_a_mesh(tmp_path: Path) -> None:
    runs = [
        _result("a", 1, 50.0),
        _result("a", 4, 90.0),
        RunResult("offline", "w64", "bf16", 0, 10, 1280, 1280, 0.0),
    ]  # NaN tok/s
    markdown = write_report(runs, tmp_path, "r", "T", extra_header_lines=["- header"])
    # The machine that measured comes first: CPU model, ISA flags, torch.
    assert markdown.startswith(f"# T\n\n{machine_markdown()}\n\n- header\n\n| engine")
    assert load_results(tmp_path / "r.json") == runs
    data = json.loads((tmp_path / "r.json").read_text(), parse_constant=pytest.fail)  # no NaN
    assert data["machine"]["isa"] == cpu_features().isa_summary
    assert {p.name for p in tmp_path.iterdir()} == {
        "r.md",
        "r.json",
        "r-latency.png",
        "r-throughput.png",
    }


def test_report_with_raw_dir_commits_only_summaries(tmp_path: Path) -> None:
    """bench/results keeps <name>.json small: the samples go to raw_dir, readable back."""
    runs = [_result("a", 1, 50.0), _result("a", 4, 90.0)]
    out, raw = tmp_path / "results", tmp_path / "results" / "raw"
    write_report(runs, out, "r", "T", raw_dir=raw)
    assert load_results(raw / "r.json") == runs
    summary = json.loads((out / "r.json").read_text(), parse_constant=pytest.fail)
    assert summary["runs"] == json.loads(json.dumps([r.summary() for r in runs]))
    assert all(set(run["ttft_ms"]) == {"p50", "p90", "p99", "mean"} for run in summary["runs"])
    assert {p.name for p in out.iterdir()} == {
        "r.md",
        "r.json",
        "r-latency.png",
        "r-throughput.png",
        "raw",
    }


# ---------------------------------------------------------------- against a real mesh
# One mesh serving mTLS with an API key, so that every run also goes through the client's
# TLS and key handling (as `pagemesh generate` dials: pagemesh.runtime.tls, --tls-* flags).

MAX_TOKENS = 8
API_KEY = "sk-bench"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertFiles:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def mesh(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, certs: CertFiles
) -> Iterator[tuple[Mesh, str]]:
    """The mesh and its HTTPS base URL."""
    model = write_tiny_model(tmp_path_factory.mktemp("loadgen") / "tiny-llama", "llama", seed=1)
    log = tmp_path_factory.mktemp("logs") / "loadgen-mesh.log"
    http_port = reserve_port()
    mesh = Mesh(
        str(model),
        log,
        redis_url=redis_url,
        cluster="bench-loadgen",
        client_tls=certs.client_tls(),
        extra_args=[
            "--http-port",
            str(http_port),
            "--api-key",
            API_KEY,
            *certs.server_tls().flags(),
        ],
    )
    try:
        mesh.wait_ready()
        url = f"https://127.0.0.1:{http_port}"
        context = ssl.create_default_context(cafile=str(certs.ca))
        context.load_cert_chain(str(certs.client_cert), str(certs.client_key))
        deadline = time.monotonic() + 30  # HTTP starts just after gRPC health
        while True:
            try:
                if httpx.get(f"{url}/health", verify=context, timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, mesh.log()
            time.sleep(0.2)
        yield mesh, url
    finally:
        mesh.stop()


@pytest.fixture(scope="module")
def grpc_target(mesh: tuple[Mesh, str], certs: CertFiles) -> Target:
    return Target(mesh[0].address, tls=certs.client_tls(), api_key=API_KEY)


@pytest.fixture(scope="module")
def http_target(mesh: tuple[Mesh, str], certs: CertFiles) -> Target:
    return Target(http_url=mesh[1], tls=certs.client_tls(), api_key=API_KEY)


@pytest.fixture(scope="module")
def workload(grpc_target: Target) -> Workload:
    info = fetch_model_info(grpc_target)
    assert (info.vocab_size, info.max_model_len, info.dtype) == (512, 512, "float32")
    return build_workload(
        "w64", num_requests=6, prompt_len=16, max_tokens=MAX_TOKENS, vocab_size=info.vocab_size
    )


def _assert_complete(result: RunResult, num_requests: int) -> None:
    """Every request came back with exactly MAX_TOKENS tokens, and sampled as such."""
    assert (result.num_errors, result.num_requests) == (0, num_requests), result.notes
    assert result.output_tokens == num_requests * MAX_TOKENS
    assert "did not return exactly" not in result.notes
    assert len(result.ttft_ms) == len(result.e2e_ms) == num_requests
    assert len(result.itl_ms) == num_requests * (MAX_TOKENS - 1)
    assert all(0 < t <= e for t, e in zip(result.ttft_ms, result.e2e_ms))
    assert min(result.itl_ms) >= 0 and result.output_tok_s > 0


def test_grpc_concurrency_sweep(grpc_target: Target, workload: Workload, tmp_path: Path) -> None:
    results = run_sweep(grpc_target, workload, [Level(1), Level(3)], warmup=1)
    assert [(r.engine, r.concurrency, r.request_rate) for r in results] == [
        ("pagemesh gRPC", 1, 0.0),
        ("pagemesh gRPC", 3, 0.0),
    ]
    for result in results:
        _assert_complete(result, 6)
        assert result.workload == "w64" and result.dtype == "float32"
        assert result.prompt_tokens == 6 * 16
    markdown = write_report(results, tmp_path, "sweep", "sweep")
    assert markdown.count("| pagemesh gRPC | w64 |") == 2
    for suffix in (".md", ".json", "-latency.png", "-throughput.png"):
        assert (tmp_path / f"sweep{suffix}").stat().st_size > 0
    data = json.loads((tmp_path / "sweep.json").read_text())
    assert [RunResult.from_json(run) for run in data["runs"]] == results
    assert data["runs"][1]["summary"]["ttft_ms"]["p50"] > 0


def test_http_open_loop(http_target: Target, workload: Workload) -> None:
    rate = 20.0
    result = run_workload(http_target, workload, request_rate=rate)
    _assert_complete(result, 6)
    assert (result.engine, result.request_rate, result.concurrency) == ("pagemesh HTTP", rate, 0)
    # Requests were sent at the seed's Poisson times: the run lasts past the last one.
    assert result.duration_s >= poisson_arrivals(6, rate, seed=0)[-1]
    capped = run_workload(
        http_target, workload, request_rate=rate, concurrency=2, warmup=0, engine="capped"
    )
    _assert_complete(capped, 6)
    assert (capped.engine, capped.concurrency) == ("capped", 2)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_bad_request_is_an_error_not_a_crash(
    grpc_target: Target, http_target: Target, workload: Workload, protocol: str
) -> None:
    good = workload.requests[:2]
    too_long = BenchRequest(workload.requests[2].prompt_token_ids, 1000)  # context is 512
    mixed = Workload("mixed", [good[0], too_long, good[1]], "two good, one too long")
    target = grpc_target if protocol == "grpc" else http_target
    result = run_workload(target, mixed, concurrency=2, warmup=0)
    assert (result.num_requests, result.num_errors) == (2, 1)
    assert result.output_tokens == 2 * MAX_TOKENS and len(result.ttft_ms) == 2
    assert ("INVALID_ARGUMENT" if protocol == "grpc" else "HTTP 400") in result.notes


def test_cli(
    mesh: tuple[Mesh, str], certs: CertFiles, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    address, url = mesh[0].address, mesh[1]
    common = [
        "--num-requests",
        "4",
        "--prompt-len",
        "32",
        "--max-tokens",
        str(MAX_TOKENS),
        "--warmup",
        "1",
        "--no-progress",
        "--output-dir",
        str(tmp_path),
        *certs.client_tls().flags(),
    ]
    assert cli.main(["--address", address, *common]) == 2  # no API key: a message, no traceback
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    code = cli.main(
        [
            "--address",
            address,
            "--api-key",
            API_KEY,
            "--workload",
            "shared-prefix",
            "--concurrency",
            "2",
            "--name",
            "cli",
            *common,
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "| pagemesh gRPC | shared-prefix | 2 |" in out and "prompt ids < 512" in out
    (result,) = load_results(tmp_path / "cli.json")
    _assert_complete(result, 4)
    assert (tmp_path / "cli-latency.png").exists() and not (
        tmp_path / "cli-throughput.png"
    ).exists()
    assert not math.isnan(result.summary()["itl_ms"]["p99"])
    # HTTPS: the vocabulary size is not in OpenAI's API, so it comes from the flag.
    code = cli.main(
        [
            "--http",
            url,
            "--api-key",
            API_KEY,
            "--vocab-size",
            "512",
            "--concurrency",
            "1,2",
            "--name",
            "https",
            *common,
        ]
    )
    assert code == 0
    assert [r.concurrency for r in load_results(tmp_path / "https.json")] == [1, 2]
    assert (tmp_path / "https-throughput.png").exists()
