"""Makes the docs' screenshots from a real run: docs/assets/screenshots/top.svg and grafana.png.

    .venv/bin/python -m docs._tools.screenshots      (or: python docs/_tools/screenshots.py)

Starts a real local mesh (`pagemesh up` through pagemesh.tools.mesh_process: the default
model, SmolLM2-135M, two engine groups on the CPU), sends it concurrent streaming traffic,
captures `pagemesh top` (its textual app, run headless) mid-run, and scrapes every
service's /metrics every few seconds. Grafana is not run here: docs/_tools/dashboard.py
evaluates the dashboard's PromQL over those scrapes (docs/_tools/promql.py) and draws its
panels. Every process started is stopped at the end. About two minutes on two cores.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pickle
import platform
import random
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # run as a file: the checkout's packages
    sys.path.insert(0, str(REPO_ROOT))

from docs._tools import dashboard  # noqa: E402
from docs._tools.promql import Scrape, parse_scrape  # noqa: E402
from pagemesh.tools.mesh_process import Mesh  # noqa: E402
from pagemesh.tools.top import ClusterReader  # noqa: E402
from protos.pagemesh.v1 import generate_pb2  # noqa: E402

OUT_DIR = REPO_ROOT / "docs" / "assets" / "screenshots"
DASHBOARD = REPO_ROOT / "compose" / "observability" / "grafana" / "dashboards" / "pagemesh.json"
CLUSTER = "pagemesh"
# Two engine groups; a small KV cache (96 blocks of 16 tokens each), so that the KV panels
# read in whole percents rather than at ~0%.
MESH_ARGS = ["--replicas", "2", "--num-kv-blocks", "96", "--dtype", "float32"]
# Prompts open with one of a few preambles: requests with the same one hit the prefix cache,
# and prefix-aware routing spreads the preambles over the groups. (A chat template would
# give every prompt the same first blocks, so every request would follow the first group.)
PREAMBLES = [
    "The following are short questions about geography, each followed by a correct answer "
    "in one sentence.",
    "Here are questions a student asked in a physics class, with the teacher's short answers.",
    "A computer science glossary, written as questions and brief answers for new engineers.",
    "Trivia night: questions about history, literature and nature, answered in a few words.",
]
QUESTIONS = [
    "What is the capital of France?",
    "Why is the sky blue?",
    "What does a CPU cache do?",
    "Name three prime numbers.",
    "What is a KV cache in a transformer?",
    "How do bees make honey?",
    "What is the boiling point of water?",
    "Explain paged attention briefly.",
    "Who wrote Hamlet?",
    "What is gRPC?",
]


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def client_loop(mesh: Mesh, stop: threading.Event, seed: int, counts: list[int]) -> None:
    """Streams requests back to back until `stop`: varied lengths, shared preambles (prefix
    cache hits), a stop string, some with two samples."""
    rng = random.Random(seed)
    while not stop.is_set():
        request = generate_pb2.GenerateRequest(
            text=f"{rng.choice(PREAMBLES)}\n\nQ: {rng.choice(QUESTIONS)}\nA:",
            n=2 if rng.random() < 0.2 else 1,
        )
        request.stopping.stop.append("\nQ:")
        request.sampling.temperature = 0.7
        request.sampling.seed = rng.randrange(1 << 30)
        request.stopping.max_tokens = rng.randint(16, 72)
        try:
            for _ in mesh.stub.Generate(request, timeout=120):
                if stop.is_set():
                    break
            counts[0] += 1
        except Exception as exc:  # noqa: BLE001 - a failed request is counted, not fatal
            counts[1] += 1
            print(f"request failed: {exc}", file=sys.stderr)


def scrape_loop(
    reader: ClusterReader, stop: threading.Event, interval_s: float, scrapes: list[Scrape]
) -> None:
    """Scrapes every service's /metrics, where its registry entry says it serves."""
    while not stop.is_set():
        t = time.time()
        records = reader.scrape_all(reader.read_registry())
        texts = {r.entry.metrics_address: r.metrics_text for r in records if r.metrics_text}
        scrapes.append(parse_scrape(t, texts))
        stop.wait(max(0.0, interval_s - (time.time() - t)))


async def capture_top(reader: ClusterReader, path: Path, size: tuple[int, int]) -> None:
    """`pagemesh top`'s live view, headless, after a few refreshes (its rates need two)."""
    from pagemesh.tools.top_app import TopApp

    app = TopApp(reader.read, 2.0, CLUSTER)
    async with app.run_test(size=size) as pilot:
        while app.num_refreshes < 3:
            await pilot.pause(0.25)
        path.write_text(app.export_screenshot(title="pagemesh top"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR)
    parser.add_argument("--clients", type=int, default=6, help="concurrent streaming clients")
    parser.add_argument("--load-s", type=float, default=70.0, help="seconds of traffic")
    parser.add_argument(
        "--idle-s", type=float, default=12.0, help="seconds scraped before the traffic starts"
    )
    parser.add_argument("--scrape-interval-s", type=float, default=2.0)
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    log = Path(tempfile.mkdtemp(prefix="pagemesh-screenshots-")) / "mesh.log"
    print(f"starting the mesh (log: {log})", flush=True)
    mesh = Mesh(None, log, cluster=CLUSTER, extra_args=MESH_ARGS, repo_root=REPO_ROOT)
    stop_load, stop_scrapes = threading.Event(), threading.Event()
    threads: list[threading.Thread] = []
    scrapes: list[Scrape] = []
    counts = [0, 0]  # requests finished, failed
    reader = top_reader = None
    try:
        mesh.wait_ready(timeout_s=600)
        started = time.time()
        reader = ClusterReader(mesh.redis_url, CLUSTER)
        top_reader = ClusterReader(mesh.redis_url, CLUSTER)
        scraper = threading.Thread(
            target=scrape_loop,
            daemon=True,
            args=(reader, stop_scrapes, args.scrape_interval_s, scrapes),
        )
        scraper.start()
        time.sleep(args.idle_s)  # an idle start, then the load ramps up
        for i in range(args.clients):
            threads.append(
                threading.Thread(target=client_loop, daemon=True, args=(mesh, stop_load, i, counts))
            )
            threads[-1].start()
            time.sleep(2.0)
        time.sleep(max(0.0, args.load_s / 2 - 2.0 * args.clients))
        print("capturing pagemesh top", flush=True)
        asyncio.run(capture_top(top_reader, args.out_dir / "top.svg", (148, 26)))
        time.sleep(args.load_s / 2)
        # The range ends under load, as a dashboard looked at during the run shows it.
        stop_scrapes.set()
        scraper.join(timeout=30)
        stop_load.set()
        for thread in threads:
            thread.join(timeout=150)
        # Kept beside the log, to redraw without a run: dashboard.draw(..., pickle.load(...))
        (log.parent / "scrapes.pickle").write_bytes(pickle.dumps(scrapes))
        print(
            f"{counts[0]} requests finished, {counts[1]} failed, {len(scrapes)} scrapes "
            f"over {time.time() - started:.0f} s",
            flush=True,
        )
    finally:
        stop_load.set()
        stop_scrapes.set()
        for r in (reader, top_reader):
            if r is not None:
                r.close()
        code = mesh.stop()
        print(f"mesh stopped (exit status {code})", flush=True)
    num_cores = len(os.sched_getaffinity(0))
    footer = (
        f"{datetime.now():%Y-%m-%d %H:%M}  ·  {cpu_model()}, {num_cores} cores  ·  "
        f"pagemesh up {' '.join(MESH_ARGS)} (SmolLM2-135M-Instruct)  ·  {args.clients} "
        f"streaming clients, {counts[0]} requests  ·  scraped every "
        f"{args.scrape_interval_s:g} s, rate window {4 * args.scrape_interval_s:g} s"
    )
    dashboard.draw(
        DASHBOARD,
        scrapes,
        args.out_dir / "grafana.png",
        "The Grafana dashboard's panels (compose/observability/grafana/dashboards/"
        "pagemesh.json), drawn from a real run's metrics by "
        "docs/_tools/screenshots.py (Grafana is not run here)",
        footer,
        rate_interval_s=4 * args.scrape_interval_s,
    )
    print(f"wrote {args.out_dir / 'top.svg'} and {args.out_dir / 'grafana.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
