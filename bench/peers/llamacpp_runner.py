"""llama.cpp (through llama-cpp-python's C bindings) as a peer of `pagemesh bench`.

A script for the llama venv's python (.peers/llama/bin/python, made by
scripts/install_peers.sh); it imports nothing from this repo and writes its results by hand as
dicts with `pagemesh.tools.loadgen.result.RunResult`'s keys.

    .peers/llama/bin/python bench/peers/llamacpp_runner.py --model DIR --prompts FILE --dtype D

FILE is JSON {"prompts": [[token ids]], "max_tokens": N}. Stdout receives exactly one line,
JSON {"results": [RunResult dicts], "token_ids": [[new ids per prompt]], "gguf": path}.

1. The HF folder becomes GGUF (f32 for float32, bf16 for bfloat16) with the
   convert_hf_to_gguf.py of the llama-cpp-python sdist that install_peers.sh unpacked in
   .peers/src/, cached under .peers/models/. The converter insists on a tokenizer it knows
   (a sentencepiece tokenizer.model, or a BPE tokenizer.json whose pre-tokenizer hash is in its
   table; the random test and W64 models have neither). Prompts are token ids, so the
   tokenizer is never used: when the folder does not convert as it is, a COPY of it under
   .peers/models/ (weights symlinked) gets a small sentencepiece tokenizer, and the converter
   pads the vocabulary to the model's size. The original folder is never modified.
2. All prompts at once with one KV stream per sequence (`kv_unified=False`; a shared stream was
   4-5x slower at 64 sequences, shared/PEERS.md): prefill in chunks of whole prompts, then one
   decode call per step for every sequence. Greedy by argmax over the logits, EOS ignored; the
   KV cache has the weights' dtype, as vLLM's and pagemesh's do; flash attention is llama.cpp's
   default (auto), `--flash-attn off` for exact fp32. Each request's TTFT is when the prefill
   chunk holding it returned; ITL are the decode steps.
3. Idle TTFT: one prompt, one token, on the emptied cache; median of 5.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

PEERS_DIR = Path(__file__).resolve().parents[2] / ".peers"
OUTTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
GGML_TYPES = {"float32": 0, "float16": 1, "bfloat16": 30}  # ggml.h's GGML_TYPE_*
# llama.cpp's default is auto (on for CPU). Its CPU kernel rounds to f16 on the way, enough to
# flip fp32 greedy near-ties against transformers; "off" is exact (what the tests use).
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}
TOKENIZER_TEXT = """\
the quick brown fox jumps over the lazy dog while a paged key value cache keeps every token
in blocks of fixed size and the scheduler chooses which requests run in each step of decoding
one two three four five six seven eight nine ten hello world what is the weather like today
"""
NUM_IDLE_TTFT_SAMPLES = 5
SEQ_CONTEXT = 512  # KV cells per sequence: vLLM's max_model_len in the same benchmark


class ConversionError(RuntimeError):
    pass


def find_converter(peers_dir: Path) -> Path:
    """convert_hf_to_gguf.py of the unpacked sdist matching the installed llama_cpp."""
    import llama_cpp

    script = (
        peers_dir
        / "src"
        / f"llama_cpp_python-{llama_cpp.__version__}"
        / "vendor"
        / "llama.cpp"
        / "convert_hf_to_gguf.py"
    )
    if not script.exists():
        raise ConversionError(f"{script} missing: run scripts/install_peers.sh llama")
    return script


def _fingerprint(model_dir: Path) -> str:
    """Names a folder's conversions: its path, config and weight files' sizes and mtimes."""
    digest = hashlib.sha256(str(model_dir.resolve()).encode())
    for path in sorted(model_dir.iterdir()):
        if path.suffix in (".json", ".safetensors", ".bin", ".model"):
            stat = path.stat()
            digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:12]


def _convert(converter: Path, model_dir: Path, outfile: Path, outtype: str) -> str | None:
    """Run the converter; None on success, else the tail of its output."""
    tmp = outfile.with_suffix(".tmp")
    env = dict(os.environ, PYTHONPATH=str(converter.parent / "gguf-py"))
    proc = subprocess.run(
        [
            sys.executable,
            str(converter),
            str(model_dir),
            "--outfile",
            str(tmp),
            "--outtype",
            outtype,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        return "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
    tmp.rename(outfile)
    return None


def copy_with_tokenizer(model_dir: Path, copy_dir: Path) -> Path:
    """A copy of `model_dir` (weights symlinked) whose only tokenizer is a small sentencepiece
    model, which the converter accepts and pads to the config's vocab_size."""
    import io

    import sentencepiece as spm

    if copy_dir.exists():
        shutil.rmtree(copy_dir)
    copy_dir.mkdir(parents=True)
    for path in model_dir.iterdir():
        if path.suffix == ".safetensors" or path.name.endswith(".safetensors.index.json"):
            (copy_dir / path.name).symlink_to(path.resolve())
        elif path.name in ("config.json", "generation_config.json"):
            shutil.copy(path, copy_dir / path.name)
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TOKENIZER_TEXT.splitlines()),
        model_writer=model,
        vocab_size=min(64, vocab_size),
        model_type="bpe",
        hard_vocab_limit=False,
        character_coverage=1.0,
        minloglevel=2,
    )
    (copy_dir / "tokenizer.model").write_bytes(model.getvalue())
    return copy_dir


def to_gguf(model_dir: str | Path, dtype: str, peers_dir: Path = PEERS_DIR) -> Path:
    """The GGUF of `model_dir` in `dtype`, converted once and cached under peers_dir/models/."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").exists():
        raise ConversionError(f"{model_dir} has no config.json: not a Hugging Face model folder")
    cache = peers_dir / "models" / f"{model_dir.name}-{_fingerprint(model_dir)}"
    outfile = cache / f"model-{OUTTYPES[dtype]}.gguf"
    if outfile.exists():
        return outfile
    cache.mkdir(parents=True, exist_ok=True)
    converter = find_converter(peers_dir)
    as_is = _convert(converter, model_dir, outfile, OUTTYPES[dtype])
    if as_is is None:
        return outfile
    print(
        f"llamacpp_runner: {model_dir} does not convert as it is; retrying on a copy with a "
        f"sentencepiece tokenizer. Converter said:\n{as_is}",
        file=sys.stderr,
    )
    copied = _convert(
        converter, copy_with_tokenizer(model_dir, cache / "hf-copy"), outfile, OUTTYPES[dtype]
    )
    if copied is not None:
        raise ConversionError(
            f"cannot convert {model_dir} to GGUF ({OUTTYPES[dtype]}).\nAs it is:\n{as_is}\n"
            f"With a sentencepiece tokenizer added to a copy:\n{copied}"
        )
    return outfile


class BatchedEngine:
    """A llama.cpp context holding `num_seqs` independent sequences (one KV stream each), with
    greedy steps over token-id prompts. Thin over llama-cpp-python's C API: the high-level
    `Llama` class drives a single sequence."""

    def __init__(
        self,
        gguf: Path,
        dtype: str,
        num_seqs: int,
        num_threads: int,
        batch_size: int = 2048,
        flash_attn: str = "auto",
    ) -> None:
        import llama_cpp as ll

        self.ll = ll
        ll.llama_backend_init()
        model_params = ll.llama_model_default_params()
        model_params.n_gpu_layers = 0
        self.model = ll.llama_model_load_from_file(str(gguf).encode(), model_params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        ctx_params = ll.llama_context_default_params()
        ctx_params.n_ctx = num_seqs * SEQ_CONTEXT
        ctx_params.n_seq_max = num_seqs
        ctx_params.kv_unified = False
        ctx_params.n_batch = batch_size
        ctx_params.n_ubatch = min(512, batch_size)
        ctx_params.n_threads = ctx_params.n_threads_batch = num_threads
        ctx_params.type_k = ctx_params.type_v = GGML_TYPES[dtype]
        ctx_params.flash_attn_type = FLASH_ATTN[flash_attn]
        ctx_params.no_perf = True
        self.ctx = ll.llama_init_from_model(self.model, ctx_params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create the context")
        self.batch_size = batch_size
        self.n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model))
        self.batch = ll.llama_batch_init(max(batch_size, num_seqs), 0, 1)

    def clear(self) -> None:
        self.ll.llama_memory_clear(self.ll.llama_get_memory(self.ctx), True)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """One llama_decode of (token, pos, seq, wants_logits) entries; the argmax of each
        entry that wants logits, in entry order."""
        import numpy as np

        batch = self.batch
        batch.n_tokens = len(entries)
        for i, (token, pos, seq, wants_logits) in enumerate(entries):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = wants_logits
        status = self.ll.llama_decode(self.ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")
        picks = []
        for i, entry in enumerate(entries):
            if entry[3]:
                logits = np.ctypeslib.as_array(
                    self.ll.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,)
                )
                picks.append(int(logits.argmax()))
        return picks

    def _prefill_chunks(self, prompts: list[list[int]]):
        """Sequence indices grouped so that each group's prompts fit in one n_batch."""
        chunk: list[int] = []
        num_tokens = 0
        for seq, prompt in enumerate(prompts):
            if len(prompt) > self.batch_size:
                raise ValueError(f"prompt {seq} is longer than n_batch {self.batch_size}")
            if chunk and num_tokens + len(prompt) > self.batch_size:
                yield chunk
                chunk, num_tokens = [], 0
            chunk.append(seq)
            num_tokens += len(prompt)
        if chunk:
            yield chunk

    def generate(
        self, prompts: list[list[int]], max_tokens: int
    ) -> tuple[list[list[int]], list[float], list[float], float]:
        """Greedy `max_tokens` for every prompt, all at once: (new tokens per prompt, each
        prompt's first-token time, each decode step's end time, start time), perf_counter s."""
        self.clear()
        start = time.perf_counter()
        tokens: list[list[int]] = [[] for _ in prompts]
        first_token_s = [0.0] * len(prompts)
        for chunk in self._prefill_chunks(prompts):
            entries = [
                (t, pos, s, pos == len(prompts[s]) - 1)
                for s in chunk
                for pos, t in enumerate(prompts[s])
            ]
            picks = self._decode(entries)
            now = time.perf_counter()
            for s, pick in zip(chunk, picks):
                tokens[s].append(pick)
                first_token_s[s] = now
        step_s: list[float] = []
        for _ in range(max_tokens - 1):
            entries = [
                (tokens[s][-1], len(prompts[s]) + len(tokens[s]) - 1, s, True)
                for s in range(len(prompts))
            ]
            for s, pick in enumerate(self._decode(entries)):
                tokens[s].append(pick)
            step_s.append(time.perf_counter())
        return tokens, first_token_s, step_s, start

    def close(self) -> None:
        self.ll.llama_batch_free(self.batch)
        self.ll.llama_free(self.ctx)
        self.ll.llama_model_free(self.model)


def run_result(
    engine: str,
    workload: str,
    dtype: str,
    concurrency: int,
    prompts: list[list[int]],
    output_tokens: int,
    duration_s: float,
    ttft_ms: list[float],
    itl_ms: list[float],
    e2e_ms: list[float],
    notes: str,
) -> dict:
    """A RunResult as a dict, its keys written out by hand (this venv cannot import it)."""
    return {
        "engine": engine,
        "workload": workload,
        "dtype": dtype,
        "concurrency": concurrency,
        "num_requests": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts),
        "output_tokens": output_tokens,
        "duration_s": duration_s,
        "request_rate": 0.0,
        "ttft_ms": ttft_ms,
        "itl_ms": itl_ms,
        "e2e_ms": e2e_ms,
        "num_errors": 0,
        "notes": notes,
    }


def measure(
    engine: BatchedEngine,
    prompts: list[list[int]],
    max_tokens: int,
    dtype: str,
    workload: str,
    label: str,
) -> dict:
    """Warm-up, all-at-once throughput, then the idle TTFT; returns the stdout JSON."""
    engine.generate([p[:8] for p in prompts[:2]], 2)
    tokens, first_s, step_s, start = engine.generate(prompts, max_tokens)
    end = step_s[-1] if step_s else max(first_s)
    # Every sequence takes part in every decode step: its gaps are the step durations.
    gaps = [1000 * (b - a) for a, b in zip([max(first_s)] + step_s, step_s)]
    throughput = run_result(
        f"{label} all at once",
        workload,
        dtype,
        0,
        prompts,
        sum(len(t) for t in tokens),
        end - start,
        ttft_ms=[1000 * (f - start) for f in first_s],
        itl_ms=gaps * len(prompts),
        e2e_ms=[1000 * (end - start)] * len(prompts),
        notes="one KV stream per sequence; prefill in chunks of whole prompts, then one "
        "decode per step for all",
    )
    probes = [prompts[i % len(prompts)] for i in range(NUM_IDLE_TTFT_SAMPLES)]
    ttft_ms = []
    for probe in probes:
        _, first, _, begin = engine.generate([probe], 1)
        ttft_ms.append(1000 * (first[0] - begin))
    idle = run_result(
        f"{label} idle TTFT",
        f"{workload}-idle-ttft",
        dtype,
        1,
        probes,
        len(probes),
        sum(ttft_ms) / 1000,
        ttft_ms=ttft_ms,
        itl_ms=[],
        e2e_ms=ttft_ms,
        notes=f"one prompt, one token, emptied cache; median {statistics.median(ttft_ms):.1f} ms",
    )
    return {"results": [throughput, idle], "token_ids": tokens}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="llama.cpp peer of pagemesh bench")
    parser.add_argument("--model", required=True, help="Hugging Face model folder")
    parser.add_argument("--prompts", required=True, help="JSON {prompts, max_tokens}")
    parser.add_argument("--dtype", default="float32", choices=sorted(OUTTYPES))
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--flash-attn", default="auto", choices=sorted(FLASH_ATTN))
    parser.add_argument("--peers-dir", default=str(PEERS_DIR))
    parser.add_argument("--workload", default="w64")
    args = parser.parse_args(argv)
    spec = json.loads(Path(args.prompts).read_text())
    json_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # llama.cpp and the converter log freely; stdout carries only the JSON
    try:
        gguf = to_gguf(args.model, args.dtype, Path(args.peers_dir))
    except ConversionError as error:
        print(f"llamacpp_runner: {error}", file=sys.stderr)
        sys.exit(3)
    engine = BatchedEngine(
        gguf, args.dtype, len(spec["prompts"]), args.threads, flash_attn=args.flash_attn
    )
    label = f"llama.cpp {OUTTYPES[args.dtype]}" + (
        "" if args.flash_attn == "auto" else f" flash-attn {args.flash_attn}"
    )
    report = measure(engine, spec["prompts"], spec["max_tokens"], args.dtype, args.workload, label)
    report["gguf"] = str(gguf)
    engine.close()
    json_out.write(json.dumps(report) + "\n")
    json_out.flush()


if __name__ == "__main__":
    main()
