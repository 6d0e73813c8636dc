"""llama.cpp, the peer the benchmarks measure against: the copy llama-cpp-python vendors, built for
this CPU from its sdist (once, under CACHE_DIR/peer), and a checkpoint converted to GGUF by that
copy's converter. Its server starts with `servers.llama_server`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

LLAMA_CPP_PYTHON = "0.3.36"


def _run(command: list[str], log: Path, cwd: Path | None = None, env: dict | None = None) -> None:
    with open(log, "a") as out:
        out.write(f"\n$ {' '.join(map(str, command))}\n")
        out.flush()
        result = subprocess.run(command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=env)
    if result.returncode != 0:
        raise SystemExit(f"failed ({result.returncode}): {' '.join(map(str, command))} — see {log}")


def llama_cpp(peer_dir: Path, log: Path) -> Path:
    """The vendored llama.cpp of the llama-cpp-python sdist, built (once) with llama-server and
    llama-quantize: its source directory (binaries in build/bin)."""
    source = peer_dir / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    if all((source / "build" / "bin" / b).exists() for b in ("llama-server", "llama-quantize")):
        return source
    if not source.exists():
        with tempfile.TemporaryDirectory(dir=peer_dir) as scratch:
            _run(
                [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-d", scratch,
                 f"llama-cpp-python=={LLAMA_CPP_PYTHON}"],
                log,
            )  # fmt: skip
            (archive,) = Path(scratch).glob("*.tar.gz")
            with tarfile.open(archive) as tar:
                tar.extractall(peer_dir, filter="data")
    # No network at build time: no prebuilt web UI, no TLS; this CPU's own instruction set.
    _run(
        ["cmake", "-B", "build", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_USE_PREBUILT_UI=OFF",
         "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"],
        log,
        cwd=source,
    )  # fmt: skip
    _run(
        ["cmake", "--build", "build", "--target", "llama-server", "llama-quantize", "-j", str(os.cpu_count() or 2)],
        log,
        cwd=source,
    )
    return source


# The converter (argv: llama.cpp's source, the pre-tokenizer, the converter's own arguments), told the
# checkpoint's pre-tokenizer: the service trained its tokenizer, whose hash the converter does not know.
_CONVERT = """
import runpy, sys
llama, pre_tokenizer = sys.argv[1:3]
sys.path[:0] = [llama, llama + "/gguf-py"]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre_tokenizer
sys.argv = [llama + "/convert_hf_to_gguf.py", *sys.argv[3:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
QWEN35 = ("qwen3_5", "qwen3_5_moe")  # config.json model_types


def gguf_weights(source: Path, llama: Path, out_dir: Path, log: Path, q4: bool) -> dict[str, Path]:
    """The checkpoint as GGUF (converted once): text Q8_0, vision F16 (mmproj), text Q4_0 (by way of an
    F16 text file, deleted once Q4_0 is made). Qwen3-VL's pre-tokenizer is Qwen2's (the same regex);
    Qwen3.5's is its own, and its multi-token prediction head (`mtp.*`) is left out: llama-server drafts
    with it only when told to (`--spec-type draft-mtp`), and the compared decode rows run no drafts."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {"q8_0": out_dir / "text-q8_0.gguf", "mmproj": out_dir / "mmproj-f16.gguf"}
    if q4:
        files["f16"], files["q4_0"] = out_dir / "text-f16.gguf", out_dir / "text-q4_0.gguf"
    qwen35 = json.loads((source / "config.json").read_text())["model_type"] in QWEN35
    convert = [sys.executable, "-c", _CONVERT, str(llama), "qwen35" if qwen35 else "qwen2", str(source)]
    text = [*convert, *(["--no-mtp"] if qwen35 else [])]
    for name, command in (
        ("q8_0", [*text, "--outtype", "q8_0"]),
        ("mmproj", [*convert, "--mmproj", "--outtype", "f16"]),
    ):
        if not files[name].exists():
            _run([*command, "--outfile", str(files[name])], log)
    if q4 and not files["q4_0"].exists():
        if not files["f16"].exists():
            _run([*text, "--outtype", "f16", "--outfile", str(files["f16"])], log)
        _run([str(llama / "build" / "bin" / "llama-quantize"), str(files["f16"]), str(files["q4_0"]), "Q4_0"], log)
        files.pop("f16").unlink()  # only Q4_0's input: as large as the bf16 checkpoint (18.6 GB for 30b-a3b-e32)
    files.pop("f16", None)
    return files
